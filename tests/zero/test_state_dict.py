"""Consolidated state dicts: keyed like a plain optimizer's, re-partitioned at any world size."""

import pytest
import torch

from shardwise import DistributedDataParallel, ZeroDataParallel, ZeroRedundancyOptimizer
from tests.harness import assert_rel_close, rank_slice, reference_train, run_on_ranks
from tests.zero.common import (
    RTOL,
    assert_params_equal,
    global_batch,
    loss_fn,
    make_net,
    param_groups,
)

OPT = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def _wrap(net, opt, stage):
    return DistributedDataParallel(net) if stage == 1 else ZeroDataParallel(net, opt)


def _steps(ctx, model, opt, start, stop):
    for step in range(start, stop):
        x, y = global_batch(step)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss_fn(model(xr[0]), yr[0]).backward()
        opt.step()
        opt.zero_grad()


def _first_half(ctx, stage):
    net = make_net()
    opt = ZeroRedundancyOptimizer(param_groups(net), OPT[0], **OPT[1])
    _steps(ctx, _wrap(net, opt, stage), opt, 0, 5)
    opt.consolidate_state_dict(to=ctx.world_size - 1)
    if ctx.rank != ctx.world_size - 1:
        with pytest.raises(RuntimeError, match="call consolidate_state_dict"):
            opt.state_dict()
        return None
    return net.state_dict(), opt.state_dict()


def _second_half(ctx, stage, model_state, opt_state):
    net = make_net(seed=7)
    net.load_state_dict(model_state)
    opt = ZeroRedundancyOptimizer(param_groups(net), OPT[0], **OPT[1])
    opt.load_state_dict(opt_state)
    _steps(ctx, _wrap(net, opt, stage), opt, 5, 10)
    reference = make_net()
    ref_opt = OPT[0](param_groups(reference), **OPT[1])
    for step in range(10):
        x, y = global_batch(step)
        loss_fn(reference(x[0]), y[0]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_equal(net, reference, "resumed run after 10 steps")


def _reference_state_after_5():
    def loss(model, step):
        x, y = global_batch(step)
        return loss_fn(model(x[0]), y[0])

    return reference_train(make_net, loss, lambda m: OPT[0](param_groups(m), **OPT[1]), 5,
                           seed=None).optimizer.state_dict()


@pytest.mark.parametrize(("stage", "first", "second"), [(1, 2, 4), (1, 4, 1), (2, 1, 2),
                                                        (2, 4, 2)])
def test_consolidate_then_load_at_another_world_size_continues_the_same(stage, first, second):
    model_state, opt_state = run_on_ranks(first, _first_half, stage)[-1]
    expected = _reference_state_after_5()
    # keyed exactly like the plain optimizer's state dict, with the same values
    assert opt_state["param_groups"] == expected["param_groups"]
    assert opt_state["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert_rel_close(opt_state["state"][index][key], value, RTOL, f"state {index} {key}")
    run_on_ranks(second, _second_half, stage, model_state, opt_state)


def test_consolidated_state_loads_into_a_plain_optimizer():
    model_state, opt_state = run_on_ranks(2, _first_half, 1)[-1]
    net = make_net()
    net.load_state_dict(model_state)
    plain = OPT[0](param_groups(net), **OPT[1])
    plain.load_state_dict(opt_state)
    assert plain.state_dict()["param_groups"] == opt_state["param_groups"]


def _bad_state_dicts(ctx):
    net = make_net()
    opt = ZeroRedundancyOptimizer(param_groups(net), torch.optim.Adam, lr=1e-2)
    other = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    other(torch.randn(2, 6)).sum().backward()
    other_opt.step()
    with pytest.raises(ValueError, match=r"different model: its param groups hold \[4\] "
                                         r"parameters, this optimizer's hold \[6, 2\]"):
        opt.load_state_dict(other_opt.state_dict())
    # same layout of groups and counts, but different shapes
    wide = make_net()
    wide.inp = torch.nn.Linear(6, 30)
    wide.frozen = torch.nn.Linear(30, 24)
    wide.frozen.requires_grad_(False)
    wide_opt = torch.optim.Adam(param_groups(wide), lr=1e-2)
    wide(torch.randn(2, 6)).sum().backward()
    wide_opt.step()
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 has shape \(30, 6\), "
                                         r"the parameter has shape \(24, 6\)"):
        opt.load_state_dict(wide_opt.state_dict())
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        opt.load_state_dict({"weights": 1})


def test_state_dict_from_a_different_model_is_rejected():
    run_on_ranks(2, _bad_state_dicts)
