"""Uneven inputs: torch's ``with model.join(): for x in my_batches: ...`` idiom, run with torch's
DDP and ours, against one process that averages the gradients of the ranks still training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer

from tests.compat.common import IMPLS, assert_states_close, ddp_class, state_of
from tests.harness import WORLD_SIZES, reference_train, run_on_ranks

LR = 0.1
RTOL = 1e-5


class _Net(nn.Module):
    """A buffer (BatchNorm's running statistics) makes the forward broadcast buffers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def _my_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank`` has ``2 + rank`` batches (rank 0 joins first, the last rank last)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen))
            for _ in range(2 + rank)]


def _train_with_join(ctx, impl: str, divide: bool, with_zero: bool, option: str = ""):
    torch.manual_seed(0)
    model = ddp_class(impl)(_Net(), find_unused_parameters=option == "find_unused",
                            static_graph=option == "static_graph", bucket_cap_mb=0.0002)
    if option == "comm_hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if with_zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=LR)
        joined = Join([model, opt], divide_by_initial_world_size=divide)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        joined = model.join(divide_by_initial_world_size=divide)
    with joined:
        for x, y in _my_batches(ctx.rank):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return state_of(model.module)


def _reference(world_size: int, divide: bool) -> dict[str, torch.Tensor]:
    """Step t averages the gradients of the ranks that still have a batch t (over the initial
    world size, or over the ranks still training)."""
    batches = [_my_batches(r) for r in range(world_size)]

    def loss(model, t):
        active = [b[t] for b in batches if t < len(b)]
        divisor = world_size if divide else len(active)
        return sum(F.mse_loss(model(x), y) for x, y in active).div(divisor)

    run = reference_train(_Net, loss, lambda m: torch.optim.SGD(m.parameters(), lr=LR),
                          max(len(b) for b in batches))
    return _params(run.state())


def _params(state: dict) -> dict:
    return {k: v for k, v in state.items() if "norm.running" not in k and "num_batches" not in k}


@pytest.mark.parametrize("divide", (True, False))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_join_with_uneven_batches_matches_torch_and_reference(world_size, divide):
    results = {impl: run_on_ranks(world_size, _train_with_join, impl, divide, False)
               for impl in IMPLS}
    reference = _reference(world_size, divide)
    for rank in range(world_size):
        ours, theirs = results["ours"][rank], results["torch"][rank]
        # every replica ends with the last joiner's model, parameters and buffers alike
        assert_states_close(ours, results["ours"][-1], 0.0, f"rank {rank} vs last rank")
        assert_states_close(ours, theirs, RTOL, f"rank {rank}: ours vs torch's DDP")
        assert_states_close(_params(ours), reference, RTOL, f"rank {rank}: ours vs reference")


@pytest.mark.parametrize("option", ("find_unused", "comm_hook", "static_graph"))
@pytest.mark.parametrize("world_size", (2, 4))
def test_join_with_ddp_options_matches_torch_and_reference(world_size, option):
    # joined ranks shadow the used-map all-reduce (find_unused_parameters), run the hook on
    # zero buckets (comm hook), and follow a static graph's first-iteration bookkeeping
    results = {impl: run_on_ranks(world_size, _train_with_join, impl, True, False, option)
               for impl in IMPLS}
    reference = _reference(world_size, True)
    for rank in range(world_size):
        assert_states_close(results["ours"][rank], results["torch"][rank], RTOL,
                            f"{option}, rank {rank}: ours vs torch's DDP")
        assert_states_close(_params(results["ours"][rank]), reference, RTOL,
                            f"{option}, rank {rank}: ours vs reference")


@pytest.mark.parametrize("world_size", (2, 4))
def test_join_composes_with_torch_zero_redundancy_optimizer(world_size):
    # Join([model, optimizer]) runs our main hook, then ZeRO's: torch's ZeRO steps a joined
    # rank's shard with that rank's last gradients, so there is no plain single-process
    # reference; the run must match torch's DDP with the same optimizer, on every rank.
    results = {impl: run_on_ranks(world_size, _train_with_join, impl, True, True)
               for impl in IMPLS}
    for rank in range(world_size):
        assert_states_close(results["ours"][rank], results["torch"][rank], RTOL,
                            f"rank {rank}: ours vs torch's DDP")
        assert_states_close(results["ours"][rank], results["ours"][0], 0.0,
                            f"rank {rank} vs rank 0")


def _no_sync_inside_join(ctx, impl: str):
    """Gradient accumulation (no_sync on odd micro-steps) while ranks join at different times:
    the joined ranks must skip the iterations that do not reduce."""
    torch.manual_seed(0)
    model = ddp_class(impl)(_Net())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with model.join():
        for i, (x, y) in enumerate(_my_batches(ctx.rank) * 2):
            if i % 2 == 0:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    return state_of(model.module)


@pytest.mark.parametrize("world_size", (2, 4))
def test_no_sync_inside_join_matches_torch(world_size):
    ours = run_on_ranks(world_size, _no_sync_inside_join, "ours")
    theirs = run_on_ranks(world_size, _no_sync_inside_join, "torch")
    for rank in range(world_size):
        assert_states_close(ours[rank], theirs[rank], RTOL, f"rank {rank}: ours vs torch's DDP")


def _early_termination(ctx, impl: str) -> str:
    torch.manual_seed(0)
    model = ddp_class(impl)(_Net())
    try:
        with model.join(throw_on_early_termination=True):
            for x, y in _my_batches(ctx.rank):
                F.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_throw_on_early_termination_raises_on_every_rank_like_torch():
    ours = run_on_ranks(2, _early_termination, "ours")
    theirs = run_on_ranks(2, _early_termination, "torch")
    assert ours == theirs
    assert "exhausted" in ours[0] and "exhausted" in ours[1]
