"""rpc.functions.async_execution: the reply is the returned future's value, when it completes."""

from __future__ import annotations

import pytest
import torch

import shardwise.rpc as rpc
from tests.rpc import helpers


def test_then_future_is_the_reply_with_every_call_type(rpc_world):
    x, y = torch.ones(2), torch.full((2,), 3.0)
    want = x + y + 1
    got = rpc.rpc_sync("worker1", helpers.async_add_then, args=("worker2", x, y, 1))
    assert torch.equal(got, want)
    fut = rpc.rpc_async("worker1", helpers.async_add_then, args=("worker2", x, y, 1))
    assert torch.equal(fut.wait(), want)
    assert torch.equal(
        rpc.remote("worker1", helpers.async_add_then, args=("worker2", x, y, 1)).to_here(), want)
    # on this worker too (a local call)
    assert torch.equal(rpc.rpc_sync("worker0", helpers.async_add_then,
                                    args=("worker1", x, y, 1)), want)


def test_collect_all_future_is_the_reply(rpc_world):
    xs = [torch.tensor([float(i)]) for i in range(4)]
    got = rpc.rpc_sync("worker2", helpers.async_collect, args=("worker1", xs))
    assert torch.equal(got, torch.tensor([12.0]))


def test_static_class_and_bound_methods(rpc_world):
    x, y = torch.ones(2), torch.ones(2)
    want = torch.full((2,), 4.0)
    for func in (helpers.AsyncOps.static_add, helpers.AsyncOps.class_add):
        assert torch.equal(rpc.rpc_sync("worker1", func, args=("worker2", x, y, 2)), want)
        assert torch.equal(rpc.rpc_async("worker1", func, args=("worker2", x, y, 2)).wait(),
                           want)
        assert torch.equal(rpc.remote("worker1", func, args=("worker2", x, y, 2)).to_here(),
                           want)
    ops = rpc.remote("worker1", helpers.AsyncOps)
    assert torch.equal(ops.rpc_sync().static_add("worker2", x, y, 2), want)
    assert torch.equal(ops.rpc_async().bound_add("worker2", x, y, 2).wait(), want)
    assert torch.equal(ops.remote().class_add("worker2", x, y, 2).to_here(), want)


def test_batch_update_pattern_answers_every_caller_when_the_batch_completes(rpc_world):
    batch = rpc.remote("worker1", helpers.BatchSum, args=(3,))
    futs = [rpc.rpc_async("worker1", helpers.BatchSum.add, args=(batch, torch.tensor(float(i))))
            for i in (1, 2)]
    assert not any(f.done() for f in futs)  # they cannot complete before the third call
    third = rpc.rpc_sync("worker2", helpers.call_other,
                         args=("worker1", helpers.BatchSum.add, (batch, torch.tensor(4.0))))
    assert third.item() == 7.0
    assert [f.wait().item() for f in futs] == [7.0, 7.0]


def test_errors_of_async_functions_reach_the_caller(rpc_world):
    with pytest.raises(TypeError, match="must return a torch.futures.Future, got int"):
        rpc.rpc_sync("worker1", helpers.async_not_a_future, args=(3,))
    with pytest.raises(ValueError, match="set on the future"):
        rpc.rpc_sync("worker1", helpers.async_fails, args=("set on the future",))
    with pytest.raises(ValueError, match="locally too"):
        rpc.rpc_sync("worker0", helpers.async_fails, args=("locally too",))
