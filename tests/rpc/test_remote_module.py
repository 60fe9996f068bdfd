"""RemoteModule, RRef.backward, get_rpc_timeout and is_available against local torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc import autograd as dist_autograd
from tests.harness import assert_rel_close
from tests.rpc import helpers

TOL = 1e-6


def _data(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def test_forward_and_forward_async_equal_the_local_module(rpc_world):
    torch.manual_seed(5)
    remote = rpc.RemoteModule("worker1/cpu", nn.Linear, args=(4, 3), kwargs={"bias": True})
    torch.manual_seed(5)
    local = nn.Linear(4, 3)  # same seed, created the same way
    x, _ = _data(0)
    state = remote.get_module_rref().rpc_sync().state_dict()
    local.load_state_dict(state)
    assert torch.equal(remote(x), local(x))
    assert torch.equal(remote.forward(x), local(x))
    assert torch.equal(remote.forward_async(x).wait(), local(x))
    assert remote.get_module_rref().owner_name() == "worker1"
    params = remote.remote_parameters()
    assert [p.owner_name() for p in params] == ["worker1", "worker1"]
    assert [tuple(p.to_here().shape) for p in params] == [(3, 4), (3,)]
    by_rank = rpc.RemoteModule("rank:2/cpu", nn.Linear, args=(4, 3))
    assert by_rank.get_module_rref().owner_name() == "worker2"


def test_remote_module_training_with_distributed_optimizer_equals_local_sgd(rpc_world):
    torch.manual_seed(1)
    remote = rpc.RemoteModule("worker2/cpu", nn.Linear, args=(4, 3))
    local = nn.Linear(4, 3)
    local.load_state_dict(remote.get_module_rref().rpc_sync().state_dict())
    opt = rpc.DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1,
                                   momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _data(step)
        with dist_autograd.context() as cid:
            loss = nn.functional.mse_loss(remote(x), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        local_loss = nn.functional.mse_loss(local(x), y)
        local_opt.zero_grad()
        local_loss.backward()
        local_opt.step()
        assert_rel_close(loss.detach(), local_loss.detach(), TOL)
    state = remote.get_module_rref().rpc_sync().state_dict()
    for name, value in local.state_dict().items():
        assert_rel_close(state[name], value, TOL)


def test_remote_module_sent_over_rpc_is_usable_by_the_receiver(rpc_world):
    remote = rpc.RemoteModule("worker1/cpu", nn.Linear, args=(4, 3))
    x, _ = _data(2)
    want = remote(x)
    sync_out, async_out = rpc.rpc_sync("worker2", helpers.remote_module_forward,
                                       args=(remote, x))
    assert torch.equal(sync_out, want) and torch.equal(async_out, want)
    assert rpc.rpc_sync("worker2", helpers.remote_module_owner, args=(remote,)) == "worker1"


def test_local_only_methods_raise_and_bad_devices_are_named(rpc_world):
    remote = rpc.RemoteModule("worker1", nn.Linear, args=(4, 3))  # device defaults to cpu
    with pytest.raises(ValueError, match="remote_parameters"):
        remote.parameters()
    for method in ("to", "state_dict", "named_parameters", "zero_grad"):
        with pytest.raises(ValueError, match=f"``{method}`` not supported"):
            getattr(remote, method)()
    with pytest.raises(ValueError, match="names a device but no worker"):
        rpc.RemoteModule("cpu", nn.Linear, args=(4, 3))
    with pytest.raises(ValueError, match="unknown RPC worker 'nobody'"):
        rpc.RemoteModule("nobody/cpu", nn.Linear, args=(4, 3))
    with pytest.raises(RuntimeError, match="only inside an RPC message|outside an RPC"):
        import pickle

        pickle.dumps(remote)
    assert not remote.eval().training  # train/eval act on the remote module
    assert remote.get_module_rref().rpc_sync().train().training


def test_rref_backward_local_and_distributed(rpc_world):
    x = torch.tensor([1.0, -2.0, 3.0])
    assert torch.equal(rpc.rpc_sync("worker1", helpers.local_backward_of_owned, args=(x,)), 2 * x)
    w = torch.tensor([0.5, 0.25, 2.0], requires_grad=True)
    xs = x.clone().requires_grad_()
    with dist_autograd.context() as cid:
        loss_rref = rpc.remote("worker1", helpers.scalar_loss, args=(xs, w))
        loss_rref.backward(cid)  # runs on worker1, the gradients come back here
        grads = dist_autograd.get_gradients(cid)
    assert torch.equal(grads[w], x) and torch.equal(grads[xs], w.detach())
    with pytest.raises(RuntimeError, match="owner only"):
        loss_rref.backward()
    with pytest.raises(RuntimeError, match="holds a str"):
        rpc.RRef("text").backward()


def test_rpc_timeout_and_availability(rpc_world):
    assert rpc.get_rpc_timeout() == 30.0  # the pool's option
    assert rpc.is_available() is True
