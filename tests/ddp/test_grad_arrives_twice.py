"""Every path on which a parameter's gradient reaches DDP's (or ZeRO stage 2's) buckets more
than once in a step: the result equals one process training the plain model (SGD, which a lost
or doubled contribution would move, unlike Adam), world sizes 1, 2 and 4, or it is refused with
an error that names the parameter or the cause (ERRORS), on every rank; never silently wrong.

- a layer used both inside a reentrant checkpoint and outside it (the checkpoint's inner
  backward delivers the layer's gradient separately, possibly after its bucket was launched);
- the same with a non-reentrant checkpoint (one graph: one arrival);
- a layer applied twice in one forward (autograd sums the uses: one arrival);
- two forward/backward passes before one optimizer step (each backward reduces; .grad sums);
- two backward passes through one forward (``retain_graph``, two losses): ZeRO stage 2 refused
  it only in the next forward, after the second backward had added its gradients into the
  first's reduced buffers (silently wrong gradients); it now refuses it when that backward
  starts.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise import DistributedDataParallel, ZeroDataParallel, ZeroRedundancyOptimizer
from tests.harness import WORLD_SIZES, assert_rel_close, rank_slice, run_on_ranks

# (path, wrapper) -> the error that refuses it; every other combination must be correct
ERRORS = {
    ("reentrant_in_and_out", "ddp"): r"parameter 1\.inner\.\w+ received a second gradient in "
                                     r"this backward pass after its bucket's reduction",
    ("two_backwards", "zero2"): r"ZeroDataParallel: the gradients reduced by the last backward "
                                r"are still set",
    ("retained_graph", "zero2"): r"ZeroDataParallel: the gradients reduced by the last backward "
                                 r"are still set",
}
PATHS = ["reentrant_in_and_out", "checkpoint_in_and_out", "applied_twice", "two_backwards",
         "retained_graph"]


class InAndOut(nn.Module):
    def __init__(self, width: int, path: str):
        super().__init__()
        self.inner, self.outer, self.path = nn.Linear(width, width), nn.Linear(width, width), path

    def forward(self, x):
        if self.path == "applied_twice":
            return torch.tanh(self.outer(self.inner(torch.tanh(self.inner(x)))))
        if self.path in ("reentrant_in_and_out", "checkpoint_in_and_out"):
            checked = checkpoint(self.inner, x, use_reentrant=self.path.startswith("reentrant"))
            return torch.tanh(self.outer(self.inner(x)) + checked)
        return torch.tanh(self.outer(self.inner(x)))


def _model(path: str):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), InAndOut(8, path), nn.Linear(8, 3))


def _batches(step: int, passes: int):
    gen = torch.Generator().manual_seed(step)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen))
            for _ in range(passes)]


def _train(ctx, path: str, wrapper: str):
    reference, model = _model(path), _model(path)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model, bucket_cap_mb=1e-5)  # a bucket per parameter
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
        wrapped = ZeroDataParallel(model, opt)
    passes = 2 if path == "two_backwards" else 1
    world = ctx.world_size
    for step in range(3):
        for x, y in _batches(step, passes):
            mine = rank_slice(x, ctx.rank, world), rank_slice(y, ctx.rank, world)
            _backward(wrapped(mine[0]), mine[1], path, 1.0)
            for r in range(world):
                _backward(reference(rank_slice(x, r, world)), rank_slice(y, r, world), path,
                          1 / world)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_rel_close(p.detach(), ref.detach(), 1e-5, name)


def _backward(out: torch.Tensor, y: torch.Tensor, path: str, scale: float) -> None:
    """The loss's backward; for ``retained_graph`` two losses, each with its own backward."""
    if path == "retained_graph":
        (nn.functional.mse_loss(out, y) * scale).backward(retain_graph=True)
        (out.abs().mean() * scale).backward()
    else:
        (nn.functional.mse_loss(out, y) * scale).backward()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("wrapper", ["ddp", "zero2"])
@pytest.mark.parametrize("path", PATHS)
def test_gradient_arriving_twice_is_correct_or_refused(path, wrapper, world_size):
    outcomes = run_on_ranks(world_size, _outcome, path, wrapper)
    expected = ERRORS.get((path, wrapper))
    for outcome in outcomes:
        if expected is None:
            assert outcome == "equal", outcome
        else:
            assert re.search(expected, outcome), outcome


def _outcome(ctx, path: str, wrapper: str) -> str:
    try:
        _train(ctx, path, wrapper)
    except RuntimeError as exc:
        return str(exc)
    return "equal"
