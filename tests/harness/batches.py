"""Per-step global batches and each rank's slice of them, for data-parallel tests.

A data-parallel test feeds each rank its slice of a global batch that depends only on the step,
and the single-process reference the whole batch (or the slices in rank order).
"""

from __future__ import annotations

import torch


def token_batch(step: int, micro: int, batch: int, seq_len: int,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each ``(micro, batch, seq_len)``, fixed by ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab_size, (micro, batch, seq_len + 1), generator=gen)
    return x[..., :-1], x[..., 1:]


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of the batch dimension, the second to last of ``t``."""
    per = t.shape[-2] // world_size
    return t[..., rank * per : (rank + 1) * per, :]
