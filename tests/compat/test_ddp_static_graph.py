"""``_set_static_graph()`` (and ``static_graph=True``) with reentrant activation checkpointing
that uses one layer twice, so its gradient arrives in two parts in every backward; torch's DDP
and ours against one process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise import DistributedDataParallel
from tests.compat.common import IMPLS, assert_states_close, ddp_class, state_of
from tests.harness import WORLD_SIZES, rank_slice, reference_train, run_on_ranks

STEPS = 3
RTOL = 1e-5
TINY_BUCKETS_MB = 0.0001  # about one parameter per bucket


class _SharedTwice(nn.Module):
    def __init__(self, with_unused: bool = True):
        super().__init__()
        if with_unused:  # static graphs may leave parameters unused; registered first, it is
            self.unused = nn.Linear(6, 6)  # in the last bucket and holds no other back
        self.pre = nn.Linear(4, 6)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = self.pre(x)
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.head(h)


def _batch(step: int):
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)


def _train(ctx, impl: str, via_setter: bool):
    torch.manual_seed(0)
    cls = ddp_class(impl)
    if via_setter:
        model = cls(_SharedTwice(), bucket_cap_mb=TINY_BUCKETS_MB)
        model._set_static_graph()
    else:
        model = cls(_SharedTwice(), bucket_cap_mb=TINY_BUCKETS_MB, static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.mse_loss(model(rank_slice(x, ctx.rank, ctx.world_size)),
                   rank_slice(y, ctx.rank, ctx.world_size)).backward()
        assert model.module.unused.weight.grad is None
        opt.step()
    return state_of(model.module)


def _reference():
    return reference_train(_SharedTwice, _loss,
                           lambda m: torch.optim.SGD(m.parameters(), lr=0.1), STEPS).state()


def _loss(model, step):
    x, y = _batch(step)
    return F.mse_loss(model(x), y)


@pytest.mark.parametrize("via_setter", (True, False))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_static_graph_reduces_a_twice_used_parameter_once_complete(world_size, via_setter):
    reference = _reference()
    results = {impl: run_on_ranks(world_size, _train, impl, via_setter) for impl in IMPLS}
    for rank in range(world_size):
        assert_states_close(results["ours"][rank], results["torch"][rank], RTOL,
                            f"rank {rank} vs torch")
        assert_states_close(results["ours"][rank], reference, RTOL, f"rank {rank} vs reference")


def _errors(ctx):
    torch.manual_seed(0)
    x, y = _batch(0)
    out = {}
    model = DistributedDataParallel(_SharedTwice(with_unused=False),
                                    bucket_cap_mb=TINY_BUCKETS_MB)
    try:  # without a static graph, the second part would arrive after its bucket was sent
        F.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        out["dynamic"] = str(exc)
    model = DistributedDataParallel(_SharedTwice(), static_graph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model._set_static_graph()
    out["again"] = [str(w.message) for w in caught]
    model = DistributedDataParallel(_SharedTwice(with_unused=False))
    F.mse_loss(model(x), y).backward()  # one big bucket: the second part is re-copied in time
    local = _SharedTwice(with_unused=False)
    local.load_state_dict(model.module.state_dict())
    F.mse_loss(local(x), y).backward()
    out["one_bucket"] = all(torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)
                            for p, q in zip(model.module.parameters(), local.parameters()))
    out["late"] = None
    try:
        model._set_static_graph()
    except RuntimeError as exc:
        out["late"] = str(exc)
    return out


def test_static_graph_errors():
    out = run_on_ranks(1, _errors)[0]
    assert "shared.weight" in out["dynamic"] or "shared.bias" in out["dynamic"]
    assert "static_graph=True" in out["dynamic"]
    assert any("already set" in m for m in out["again"])
    assert "before the first backward" in out["late"]
    assert out["one_bucket"]
