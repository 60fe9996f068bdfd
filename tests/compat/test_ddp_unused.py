"""``find_unused_parameters=True``: a parameter no rank used keeps ``grad is None`` (so AdamW
skips it, weight decay included), one used on some ranks gets the average with zeros from the
others; torch's DDP and ours on the same program, and a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.compat.common import IMPLS, assert_states_close, ddp_class, state_of
from tests.harness import WORLD_SIZES, reference_train, run_on_ranks

STEPS = 3
RTOL = 1e-5


class _Parts(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)  # used on rank 0 only
        self.never = nn.Linear(4, 4)  # used on no rank
        self.late = nn.Linear(4, 4)  # used, but frozen after wrapping

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = self.branch(h)
        return self.late(h)


def _data(rank: int, step: int):
    gen = torch.Generator().manual_seed(31 * step + rank)
    return torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)


def _train(ctx, impl: str):
    torch.manual_seed(0)
    model = ddp_class(impl)(_Parts(), find_unused_parameters=True)
    model.module.late.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
    grads_none = []
    for step in range(STEPS):
        x, y = _data(ctx.rank, step)
        opt.zero_grad()
        F.mse_loss(model(x, use_branch=ctx.rank == 0), y).backward()
        grads_none.append(sorted(n for n, p in model.module.named_parameters() if p.grad is None))
        opt.step()
    return grads_none, state_of(model.module)


def _reference(world_size: int):
    def frozen_late():
        model = _Parts()
        model.late.requires_grad_(False)
        return model

    def loss(model, step):
        pairs = [_data(r, step) for r in range(world_size)]
        return sum(F.mse_loss(model(x, use_branch=r == 0), y)
                   for r, (x, y) in enumerate(pairs)) / world_size

    return reference_train(frozen_late, loss, lambda m: torch.optim.AdamW(
        m.parameters(), lr=0.05, weight_decay=0.5), STEPS).state()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unused_and_late_frozen_parameters_keep_grad_none_like_torch(world_size):
    torch.manual_seed(0)
    initial = state_of(_Parts())
    reference = _reference(world_size)
    results = {impl: run_on_ranks(world_size, _train, impl) for impl in IMPLS}
    for rank in range(world_size):
        grads_none, state = results["ours"][rank]
        assert grads_none == results["torch"][rank][0]
        assert grads_none == [["late.bias", "late.weight", "never.bias", "never.weight"]] * STEPS
        for name in ("never.weight", "never.bias", "late.weight", "late.bias"):
            assert torch.equal(state[name], initial[name]), f"{name} changed"
        assert not torch.equal(state["branch.weight"], initial["branch.weight"])
        assert_states_close(state, results["torch"][rank][1], RTOL, f"rank {rank} vs torch")
        assert_states_close(state, reference, RTOL, f"rank {rank} vs reference")


def _stale_grad_kept(ctx):
    """A globally unused parameter's existing .grad is left as it is, not overwritten."""
    from shardwise import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(_Parts(), find_unused_parameters=True)
    model.module.never.weight.grad = torch.full((4, 4), 3.0)
    x, y = _data(ctx.rank, 0)
    F.mse_loss(model(x, use_branch=True), y).backward()
    return model.module.never.weight.grad


def test_globally_unused_parameter_keeps_its_existing_grad():
    for grad in run_on_ranks(2, _stale_grad_kept):
        assert torch.equal(grad, torch.full((4, 4), 3.0))
