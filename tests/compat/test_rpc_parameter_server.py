"""A parameter server that calls ``shutdown()`` right after ``init_rpc``, in the style of
pytorch/examples' RPC parameter server: trainers hold an RRef to the server's model, run its
forward by RPC inside a distributed autograd context and step a DistributedOptimizer.

Run as ``python -m tests.compat.test_rpc_parameter_server IMPL OUT_DIR`` (rank 0: the server,
ranks 1-2: trainers); the test runs it with torch's RPC and with ours and compares.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from torch import nn

from tests.rpc.launch import run_both, save

# the program's one line that differs between the two runs: the imports
IMPL = sys.argv[1] if __name__ == "__main__" else None  # pytest imports neither
if IMPL == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
elif IMPL == "shardwise":
    import shardwise.rpc as rpc
    from shardwise.rpc import DistributedOptimizer
    from shardwise.rpc import autograd as dist_autograd

STEPS = 4


class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.model(x)

    def get_param_rrefs(self):
        return [rpc.RRef(p) for p in self.model.parameters()]


_servers: dict[str, ParameterServer] = {}
_servers_lock = threading.Lock()


def get_parameter_server(trainer: str) -> ParameterServer:
    with _servers_lock:  # one model per trainer, so each trainer's run is deterministic
        if trainer not in _servers:
            _servers[trainer] = ParameterServer()
        return _servers[trainer]


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args),
                        kwargs=kwargs)


class TrainerNet(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server,
                                            args=(name,))

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def run_trainer(rank: int) -> dict:
    net = TrainerNet(f"trainer_{rank}")
    opt = DistributedOptimizer(torch.optim.SGD, net.get_global_param_rrefs(), lr=0.1,
                               momentum=0.5)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        with dist_autograd.context() as cid:
            loss = nn.functional.cross_entropy(net(x), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        losses.append(loss.detach())
    weights = [r.to_here() for r in net.get_global_param_rrefs()]
    return {"losses": torch.stack(losses), "weights": weights}


def main(impl: str, out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # warm torch.optim's imports
    if rank == 0:
        rpc.init_rpc("parameter_server", rank=rank, world_size=world)
        rpc.shutdown()  # serves the trainers until they have all shut down
        save(out_dir, impl, rank, {"server": "done"})
        return
    rpc.init_rpc(f"trainer_{rank}", rank=rank, world_size=world)
    results = run_trainer(rank)
    rpc.shutdown()
    save(out_dir, impl, rank, results)


def test_parameter_server_shut_down_at_once_trains_as_with_torch(tmp_path):
    from tests.harness import assert_rel_close

    runs = run_both("tests.compat.test_rpc_parameter_server", 3, tmp_path)
    for rank in (1, 2):
        ours, theirs = runs["shardwise"][rank], runs["torch"][rank]
        assert_rel_close(ours["losses"], theirs["losses"], 1e-6, f"trainer {rank} losses")
        for i, (a, b) in enumerate(zip(ours["weights"], theirs["weights"])):
            assert_rel_close(a, b, 1e-6, f"trainer {rank} parameter {i}")
    assert runs["torch"][1]["losses"][-1] < runs["torch"][1]["losses"][0]  # it trained


if __name__ == "__main__":
    main(*sys.argv[1:])
