"""What the framework programs of tests/integrations share: a tiny residual network, fixed
data, and the comparison of per-step losses between the torch run and the shardwise run.

Each program is a module run as ``python -m tests.integrations.test_X IMPL OUT_DIR`` on every
rank (tests/rpc/launch.py starts them with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT, as a launcher does); IMPL picks torch's wrapper or shardwise's, nothing else in
the program differs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WORLD = 2
STEPS = 10
BATCH = 4  # per rank
LR = 1e-2
# the module of the wrapper each run must have trained with
WRAPPERS = {"torch": "torch.nn.parallel.distributed", "shardwise": "shardwise.ddp.data_parallel"}


class ResNet(nn.Module):
    """A small residual network: input projection, one residual block, output head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.block(h))


def dataset(batches: int) -> torch.utils.data.TensorDataset:
    """``batches`` global batches of WORLD * BATCH samples, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    n = batches * WORLD * BATCH
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + 0.1)


def rank_batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``index``-th batch (a slice of ``dataset``)."""
    data = dataset(index + 1)
    start = (index * WORLD + rank) * BATCH
    return data.tensors[0][start:start + BATCH], data.tensors[1][start:start + BATCH]


def save(out_dir: str, impl: str, rank: int, results: dict) -> None:
    torch.save(results, Path(out_dir) / f"{impl}_rank{rank}.pt")


def compare_losses(runs: dict, steps: int) -> None:
    """Per rank and step, shardwise's loss equals torch's (1e-6 relative: both average the
    gradients of two ranks, in a possibly different summation order)."""
    from tests.harness import assert_rel_close

    for rank in range(WORLD):
        ours, theirs = runs["shardwise"][rank]["losses"], runs["torch"][rank]["losses"]
        assert ours.shape == theirs.shape == (steps,), (ours.shape, theirs.shape)
        assert_rel_close(ours, theirs, 1e-6, f"rank {rank} losses")
