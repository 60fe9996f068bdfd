"""Distributed autograd against local autograd on the same computation; DistributedOptimizer."""

from __future__ import annotations

import torch
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc import autograd as dist_autograd
from tests.harness import assert_rel_close
from tests.rpc import helpers

TOL = 1e-6


def _local_linear(state: dict) -> nn.Linear:
    out, inp = state["weight"].shape
    lin = nn.Linear(inp, out)
    lin.load_state_dict(state)
    return lin


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=g, requires_grad=True)
    w = torch.randn(5, 5, generator=g, requires_grad=True)
    return x, w


def test_gradients_equal_local_autograd_through_every_rpc(rpc_world):
    """worker0 -> worker1 (a remote module) -> worker1 -> worker2 (nested) -> back, h reused."""
    module = rpc.remote("worker1", helpers.make_linear, args=(3, 5, 5))
    x, w = _inputs(0)
    with dist_autograd.context() as cid:
        h = torch.tanh(x @ w)
        out = rpc.rpc_sync("worker1", helpers.forward, args=(module, h))
        out = rpc.rpc_sync("worker1", helpers.nested_square, args=(out, "worker2"))
        z = rpc.rpc_async("worker2", torch.mul, args=(out, h)).wait()
        loss = z.sum() + (h * h).mean()
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        remote_grads = rpc.rpc_sync("worker1", helpers.grads_of, args=(module, cid))
    assert x.grad is None and w.grad is None  # torch's rule: gradients live in the context

    xl, wl = (t.detach().clone().requires_grad_() for t in _inputs(0))
    lin = _local_linear(rpc.rpc_sync("worker1", helpers.state_of, args=(module,)))
    hl = torch.tanh(xl @ wl)
    outl = lin(hl)
    outl = outl + outl * outl
    (outl * hl).sum().add((hl * hl).mean()).backward()
    assert_rel_close(grads[x], xl.grad, TOL)
    assert_rel_close(grads[w], wl.grad, TOL)
    assert_rel_close(remote_grads["weight"], lin.weight.grad, TOL)
    assert_rel_close(remote_grads["bias"], lin.bias.grad, TOL)


def test_gradients_through_remote_and_to_here(rpc_world):
    """Activations passed between workers by RRef (the pipeline pattern)."""
    m1 = rpc.remote("worker1", helpers.make_linear, args=(4, 5, 6))
    m2 = rpc.remote("worker2", helpers.make_linear, args=(5, 6, 3))
    x, _ = _inputs(1)
    with dist_autograd.context() as cid:
        x_ref = rpc.RRef(x)
        h_ref = rpc.remote("worker1", helpers.forward_rref, args=(m1, x_ref))
        y_ref = rpc.remote("worker2", helpers.forward_rref, args=(m2, h_ref))
        loss = y_ref.to_here().pow(2).sum()
        dist_autograd.backward(cid, [loss])
        gx = dist_autograd.get_gradients(cid)[x]
        g1 = rpc.rpc_sync("worker1", helpers.grads_of, args=(m1, cid))
        g2 = rpc.rpc_sync("worker2", helpers.grads_of, args=(m2, cid))
    l1 = _local_linear(rpc.rpc_sync("worker1", helpers.state_of, args=(m1,)))
    l2 = _local_linear(rpc.rpc_sync("worker2", helpers.state_of, args=(m2,)))
    xl = x.detach().clone().requires_grad_()
    l2(l1(xl)).pow(2).sum().backward()
    assert_rel_close(gx, xl.grad, TOL)
    assert_rel_close(g1["weight"], l1.weight.grad, TOL)
    assert_rel_close(g2["weight"], l2.weight.grad, TOL)
    assert_rel_close(g2["bias"], l2.bias.grad, TOL)


def test_two_backward_passes_accumulate_in_the_context(rpc_world):
    x, _ = _inputs(2)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3.0))
        dist_autograd.backward(cid, [y.sum()])
        y2 = rpc.rpc_sync("worker2", torch.mul, args=(x, 2.0))
        dist_autograd.backward(cid, [y2.sum()])
        assert torch.equal(dist_autograd.get_gradients(cid)[x], torch.full_like(x, 5.0))


def test_distributed_optimizer_updates_remote_parameters_in_place(rpc_world):
    module = rpc.remote("worker1", helpers.make_linear, args=(7, 5, 2))
    params = rpc.rpc_sync("worker1", helpers.param_rrefs, args=(module,))
    before = rpc.rpc_sync("worker1", helpers.state_of, args=(module,))
    opt = rpc.DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
    x, _ = _inputs(3)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", helpers.forward, args=(module, x)).pow(2).sum()
        dist_autograd.backward(cid, [loss])
        opt.step(cid)
    after = rpc.rpc_sync("worker1", helpers.state_of, args=(module,))

    ref = _local_linear(before)
    ref(x.detach()).pow(2).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert not torch.equal(after["weight"], before["weight"])  # the remote module changed
    assert_rel_close(after["weight"], ref.weight.detach(), TOL)
    assert_rel_close(after["bias"], ref.bias.detach(), TOL)
    # the module's own Parameter objects were updated, not copies
    assert rpc.rpc_sync("worker1", helpers.params_are, args=(module, params))


def test_backward_outside_a_known_context_is_a_clear_error(rpc_world):
    import pytest

    with pytest.raises(RuntimeError, match="no distributed autograd context"):
        dist_autograd.backward(123456789, [torch.ones(1, requires_grad=True).sum()])


def test_a_release_racing_with_another_returns_only_once_the_graph_is_freed():
    # a pipeline's middle stage gets two releases of one context at once: the one its neighbour
    # forwards and the owner's own. The first pops the context and tells its peers (a slow send
    # here); the second finds nothing and returns at once, and the stage then counts its live
    # activations: the graph must already be gone, not held by the first call while it sends.
    import threading
    import types
    import weakref

    from shardwise.rpc.autograd.container import AutogradContainer

    sending, go_on = threading.Event(), threading.Event()

    def request(*args, **kwargs):
        sending.set()
        go_on.wait(30)
        return torch.futures.Future()

    agent = types.SimpleNamespace(rank=0, name="w", dead=set(), request=request,
                                  options=types.SimpleNamespace(rpc_timeout=30))
    contexts = AutogradContainer(agent)
    ctx = contexts.new_context()
    saved = torch.full((3,), 2.0)
    out = torch.ones(3, requires_grad=True) * saved  # the graph keeps ``saved`` for backward
    ctx.record_send(1, [out], peer=1)
    graph = weakref.ref(saved)  # alive exactly as long as the graph
    cid = ctx.context_id
    del ctx, out, saved
    assert graph() is not None
    first = threading.Thread(target=contexts.release, args=(cid,))
    first.start()
    try:
        assert sending.wait(30)
        assert contexts.release(cid) == []
        assert graph() is None  # freed before the first call began telling its peers
    finally:
        go_on.set()
        first.join(30)


def test_the_backward_pass_reaches_every_leaf_once_however_torch_wraps_graph_nodes():
    """Every parameter of a deep graph, and a leaf reached along two paths once (torch 2.12
    makes a node's Python object afresh on each access; a freed one's id is reused)."""
    from shardwise.rpc.autograd.engine import collect_leaves

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    shared = torch.ones(3, requires_grad=True)
    out = model(torch.randn(5, 6)) * shared
    loss = out.sum() + (shared * 2).sum()
    leaves = collect_leaves([loss])
    want = [*model.parameters(), shared]
    assert len(leaves) == len(want)
    assert all(any(leaf is w for leaf in leaves) for w in want)
