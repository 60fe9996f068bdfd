"""Each rank's own slice of a dataset, as torch.utils.data.DistributedSampler gives it."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


class DistributedSampler:
    """Indices ``perm[rank::num_replicas]`` of a per-epoch permutation seeded by ``seed + epoch``.

    Every rank draws the same permutation, so the ranks' slices are disjoint and together cover
    the epoch; ``drop_last`` trims the tail so every rank gets the same count (otherwise the tail
    is padded by repeating the start, as torch does).
    """

    def __init__(self, num_samples: int, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if num_samples < num_replicas:
            raise ValueError(f"{num_samples} samples cannot be split across {num_replicas} ranks")
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.per_rank = num_samples // num_replicas
        else:
            self.per_rank = math.ceil(num_samples / num_replicas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=gen).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.per_rank * self.num_replicas
        if total > len(order):
            order += order[: total - len(order)]
        return order[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.per_rank
