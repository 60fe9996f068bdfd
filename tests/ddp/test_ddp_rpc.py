"""DDP under distributed autograd: the pytorch/examples DDP + RPC pattern (a local part wrapped in
DDP, a remote part reached by RPC, ``dist_autograd.backward`` and ``DistributedOptimizer``).

Every rank of a pool world is a trainer and also hosts the remote layer of the next trainer.
The gradients the context returns for DDP's parameters must be the average over trainers on
every rank, and the weights after DistributedOptimizer steps those of one process that
averages the DDP part's gradients and applies each remote layer's own gradient.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise.rpc as rpc
from shardwise import DistributedDataParallel
from shardwise.rpc import autograd as dist_autograd
from tests.harness import assert_rel_close, run_on_ranks
from tests.harness.ports import reserved_port
from tests.rpc import helpers

STEPS = 3
LR = 0.1
RTOL = 1e-6


def _local_part() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _data(rank: int, step: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)


def _start_rpc(ctx) -> None:
    # rank 0 holds the port (tests/harness/ports.py) until its store has bound it in init_rpc
    with reserved_port() if ctx.rank == 0 else contextlib.nullcontext() as mine:
        port = [mine]
        dist.broadcast_object_list(port, src=0)
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port[0]}",
                                               rpc_timeout=30, connect_timeout=30)
        rpc.init_rpc(f"trainer{ctx.rank}", rank=ctx.rank, world_size=ctx.world_size,
                     rpc_backend_options=opts)


def _train(ctx, find_unused: bool):
    # built before RPC starts: a peer's make_linear seeds the global generator from an RPC
    # thread of this process
    model = DistributedDataParallel(_local_part(), find_unused_parameters=find_unused)
    _start_rpc(ctx)
    try:
        owner = f"trainer{(ctx.rank + 1) % ctx.world_size}"
        remote = rpc.remote(owner, helpers.make_linear, args=(1, 5, 6))
        params = rpc.rpc_sync(owner, helpers.param_rrefs, args=(remote,))
        params += [rpc.RRef(p) for p in model.parameters()]
        opt = rpc.DistributedOptimizer(torch.optim.SGD, params, lr=LR)
        grads = []
        for step in range(STEPS):
            x, y = _data(ctx.rank, step)
            with dist_autograd.context() as cid:
                h = rpc.rpc_sync(owner, helpers.forward, args=(remote, x))
                loss = F.mse_loss(model(h), y)
                dist_autograd.backward(cid, [loss])
                in_context = dist_autograd.get_gradients(cid)
                grads.append([in_context[p].clone() for p in model.parameters()])
                assert all(p.grad is None for p in model.parameters())  # torch's rule
                opt.step(cid)
        dist.barrier()  # every trainer's last step reached the remote layer it trains
        remote_state = rpc.rpc_sync(owner, helpers.state_of, args=(remote,))
        local_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        dist.barrier()
        return grads, local_state, remote_state
    finally:
        rpc.shutdown(graceful=True)


def _reference(world_size: int):
    """DDP part: SGD on the average of the trainers' gradients; each remote layer: SGD on its
    own trainer's gradient."""
    local = _local_part()
    remotes = [helpers.make_linear(1, 5, 6) for _ in range(world_size)]
    grads = []
    for step in range(STEPS):
        losses = [F.mse_loss(local(remotes[r](x)), y)
                  for r, (x, y) in ((r, _data(r, step)) for r in range(world_size))]
        mean_grads = torch.autograd.grad(sum(losses) / world_size, list(local.parameters()),
                                         retain_graph=True)
        own = [torch.autograd.grad(losses[r], list(remotes[r].parameters()), retain_graph=True)
               for r in range(world_size)]
        with torch.no_grad():
            for p, g in zip(local.parameters(), mean_grads):
                p -= LR * g
            for remote, gs in zip(remotes, own):
                for p, g in zip(remote.parameters(), gs):
                    p -= LR * g
        grads.append(mean_grads)
    return grads, local.state_dict(), [r.state_dict() for r in remotes]


@pytest.mark.parametrize("find_unused", (False, True))
@pytest.mark.parametrize("world_size", (2, 4))
def test_ddp_gradients_are_averaged_under_distributed_autograd(world_size, find_unused):
    results = run_on_ranks(world_size, _train, find_unused)
    ref_grads, ref_local, ref_remotes = _reference(world_size)
    for rank, (grads, local_state, _) in enumerate(results):
        for step in range(STEPS):
            for i, (g, want) in enumerate(zip(grads[step], ref_grads[step])):
                assert torch.equal(g, results[0][0][step][i]), f"rank {rank} step {step}"
                assert_rel_close(g, want, RTOL, f"rank {rank} step {step} grad {i}")
        for key, value in ref_local.items():
            assert torch.equal(local_state[key], results[0][1][key]), f"rank {rank}: {key}"
            assert_rel_close(local_state[key], value, RTOL, f"rank {rank}: {key}")
    for rank, (_, _, remote_state) in enumerate(results):
        # trainer r's remote layer lives on rank r + 1; it followed trainer r's gradients alone
        for key, value in ref_remotes[rank].items():
            assert_rel_close(remote_state[key], value, RTOL, f"remote layer of trainer {rank}")


def _no_sync_under_dist_autograd(ctx):
    model = DistributedDataParallel(_local_part())
    _start_rpc(ctx)
    try:
        gen = torch.Generator().manual_seed(ctx.rank)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
        out = []
        for sync in (False, True):
            with dist_autograd.context() as cid:
                if sync:
                    dist_autograd.backward(cid, [F.mse_loss(model(x), y)])
                else:
                    with model.no_sync():
                        dist_autograd.backward(cid, [F.mse_loss(model(x), y)])
                grads = dist_autograd.get_gradients(cid)
                out.append([grads[p].clone() for p in model.parameters()])
        dist.barrier()
        return out
    finally:
        rpc.shutdown(graceful=True)


def test_no_sync_keeps_local_context_gradients():
    local_grads, synced = zip(*run_on_ranks(2, _no_sync_under_dist_autograd))
    for a, b, s in zip(local_grads[0], local_grads[1], synced[0]):
        assert not torch.equal(a, b)  # each rank kept its own
        assert_rel_close(s, (a + b) / 2, RTOL, "synchronised gradient")
