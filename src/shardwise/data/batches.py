"""Fixed-length training windows and a deterministic per-step batch stream.

The batch of step ``s`` depends only on ``(seed, s)``, never on what ran before, so a resumed
run sees exactly the batches the uninterrupted run would have seen. With a global batch of
``G`` windows and ``W`` ranks, the union of the ranks' batches at a step is the batch a single
process with batch ``G`` gets at that step (the sampler slices one shared permutation).
"""

from __future__ import annotations

import torch

from shardwise.data.sampler import DistributedSampler


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` bytes: input and next-byte target."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        if data.numel() < seq_len + 1:
            raise ValueError(f"{data.numel()} tokens are too few for one window of {seq_len}")
        self.data, self.seq_len = data, seq_len
        self.count = (data.numel() - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def take(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.tensor(indices, dtype=torch.long) * self.seq_len
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)
        chunk = self.data[offsets].long()
        return chunk[:, :-1], chunk[:, 1:]


class BatchStream:
    """This rank's slice of the global batch at any step."""

    def __init__(self, windows: TokenWindows, global_batch: int, rank: int, world_size: int,
                 seed: int = 0, shuffle: bool = True):
        if global_batch < world_size:
            raise ValueError(
                f"global batch size {global_batch} is smaller than the world size {world_size}: "
                "every rank needs at least one sample"
            )
        if global_batch % world_size:
            raise ValueError(
                f"global batch size {global_batch} is not divisible by the world size {world_size}"
            )
        self.windows = windows
        self.per_rank = global_batch // world_size
        self.sampler = DistributedSampler(len(windows), world_size, rank, shuffle, seed)
        self.steps_per_epoch = len(self.sampler) // self.per_rank
        if self.steps_per_epoch < 1:
            raise ValueError(f"{len(windows)} windows are too few for a batch of {global_batch}")
        self._epoch, self._indices = -1, []

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._indices = epoch, self.sampler.indices()
        return self.windows.take(self._indices[k * self.per_rank : (k + 1) * self.per_rank])
