"""ZeroRedundancyOptimizer(overlap_with_ddp=True) attached to our DDP by hook_with_zero_step
(and the interleaved variant): parameters against one process training on the whole batch,
with torch's warm-up (no update in the first two backward passes, three with a static graph)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardwise import DistributedDataParallel, ZeroRedundancyOptimizer
from shardwise.zero import hook_with_zero_step, hook_with_zero_step_interleaved
from tests.harness import assert_rel_close, rank_slice, run_on_ranks
from tests.zero.common import RTOL, global_batch, loss_fn, make_net, optimizer_kwargs

STEPS = 10
VARIANTS = {"plain": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def _train(ctx, variant: str, opt_name: str, static: bool):
    cls, kwargs = optimizer_kwargs(opt_name)
    net = make_net(seed=ctx.rank)  # replicas start different: the wrap syncs them
    zero = ZeroRedundancyOptimizer(net.parameters(), cls, overlap_with_ddp=True, **kwargs)
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.001, static_graph=static)
    ddp.register_comm_hook(None, VARIANTS[variant](default_hooks.allreduce_hook, ddp, zero))
    reference = make_net()
    ref_opt = cls(reference.parameters(), **kwargs)
    warmup = 3 if static else 2
    for step in range(STEPS):
        x, y = global_batch(step)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss_fn(ddp(xr[0]), yr[0]).backward()  # steps and broadcasts inside
        zero.zero_grad()
        if step >= warmup:
            loss_fn(reference(x[0]), y[0]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
            assert_rel_close(p, q, RTOL, f"{variant}, step {step}: {name}")
    owned = [len(zero.owned_params(r)) for r in range(ctx.world_size)]
    zero.consolidate_state_dict(to=0)
    if ctx.rank == 0:
        state = zero.state_dict()["state"]
        ref_state = ref_opt.state_dict()["state"]
        assert state.keys() == ref_state.keys()
        for i, entry in ref_state.items():
            for key, value in entry.items():
                assert_rel_close(state[i][key], value, RTOL, f"optimizer state {i}.{key}")
    return owned, len(ddp.reducer.buckets)


@pytest.mark.parametrize("variant", tuple(VARIANTS))
@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_ten_steps_equal_single_process(world_size, variant):
    results = run_on_ranks(world_size, _train, variant, "adamw", False)
    owned, buckets = results[0]
    assert sum(owned) == 6, f"every trainable parameter has one owner: {owned}"
    # bucket i belongs to rank i % world (torch's rule): with 3 buckets at world size 4 one
    # rank owns nothing, and takes part in the broadcasts only
    assert [n > 0 for n in owned] == [r < buckets for r in range(world_size)]


@pytest.mark.parametrize("world_size", (2, 4))
def test_sgd_momentum_with_static_graph(world_size):
    run_on_ranks(world_size, _train, "interleaved", "sgd", True)


def _errors(ctx):
    from shardwise.ddp.hooks import powerSGD_hook

    net = make_net()
    plain = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    overlapped = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1,
                                         overlap_with_ddp=True)
    ddp = DistributedDataParallel(net)
    out = {}
    for key, call in (
        ("not_overlap", lambda: hook_with_zero_step(default_hooks.allreduce_hook, ddp, plain)),
        ("not_ddp", lambda: hook_with_zero_step(default_hooks.allreduce_hook, net, overlapped)),
        ("powersgd", lambda: hook_with_zero_step(powerSGD_hook, ddp, overlapped)),
        ("step", overlapped.step),
    ):
        try:
            call()
        except (TypeError, ValueError, RuntimeError) as exc:
            out[key] = str(exc)
    hook_with_zero_step_interleaved(default_hooks.allreduce_hook, ddp, overlapped)
    try:
        hook_with_zero_step(default_hooks.allreduce_hook, ddp, overlapped)
    except RuntimeError as exc:
        out["twice"] = str(exc)
    with pytest.warns(UserWarning, match="does nothing"):
        assert overlapped.step() is None
    return out


def test_bad_input_errors():
    out = run_on_ranks(1, _errors)[0]
    assert "overlap_with_ddp=True" in out["not_overlap"]
    assert "shardwise.DistributedDataParallel" in out["not_ddp"] and "Net" in out["not_ddp"]
    assert "powerSGD_hook" in out["powersgd"]
    assert "not attached" in out["step"]
    assert "already attached" in out["twice"]
