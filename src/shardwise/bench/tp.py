"""Our tensor-parallel MLP against torch's DTensor ColwiseParallel / RowwiseParallel.

Same shapes, same world size, same replicated input: ``fc2(gelu(fc1(x)))`` with fc1 sharded on
its output features and fc2 on its input features, forward + backward + zero_grad per step
(no optimizer: the comparison is of the sharded computation). Bytes communicated per step and
rank are counted from the collectives each implementation makes: ours from
``shardwise.sharded_tensor.TRAFFIC``, torch's by a dispatch mode that sees its functional
collectives (payload of each call, one untimed step).

    shardwise bench tp --nproc 2 --rounds 3 --steps 20
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise._compat import TorchDispatchMode
from shardwise.bench.sidebyside import SideBySide
from shardwise.sharded_tensor import TRAFFIC, ChunkShardingSpec, shard_module

IMPLS = ["torch-dtensor", "shardwise-tp"]


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


_COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single", "broadcast", "all_reduce_coalesced"}


class _CountCollectives(TorchDispatchMode):
    """Payload bytes of every c10d functional collective torch's DTensor issues."""

    def __init__(self):
        super().__init__()
        self.bytes = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("_c10d_functional.") and name.split(".")[1] in _COLLECTIVES:
            t = args[0]
            tensors = t if isinstance(t, (list, tuple)) else [t]
            self.bytes[name.split(".")[1]] += sum(x.numel() * x.element_size() for x in tensors)
        return func(*args, **(kwargs or {}))


def _args(parser) -> None:
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256, help="batch x sequence, replicated")


def _prepare(impl: str, args, group):
    torch.manual_seed(0)
    mlp = MLP(args.d_model, args.hidden)
    world = dist.get_world_size(group)
    if impl == "torch-dtensor":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = DeviceMesh("cpu", list(range(world)))
        parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    else:
        ranks = list(range(world))
        shard_module(mlp, {"fc1": ChunkShardingSpec(0, ranks), "fc2": ChunkShardingSpec(1, ranks)},
                     process_group=group)
    return mlp


def worker(impl: str, args, group: dist.ProcessGroup):
    mlp = _prepare(impl, args, group)
    x = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()

    def step():
        mlp(x).sum().backward()
        mlp.zero_grad(set_to_none=True)
        x.grad = None

    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if impl == "torch-dtensor":
        with _CountCollectives() as counter:
            step()
        per_step = dict(counter.bytes)
    else:
        TRAFFIC.reset()
        step()
        per_step = dict(TRAFFIC.bytes)
    out = mlp(x).detach()
    return times, {"comm_bytes_per_step": sum(per_step.values()), "by_collective": per_step,
                   "output_checksum": round(out.double().sum().item(), 3)}


BENCH = SideBySide("tp", worker, IMPLS, "torch-dtensor", _args,
                   "tensor-parallel MLP against torch's DTensor")
