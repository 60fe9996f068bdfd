"""Our tensor-parallel MLP against torch's DTensor ColwiseParallel / RowwiseParallel.

Same shapes, same world size, same replicated input: ``fc2(gelu(fc1(x)))`` with fc1 sharded on its
output features and fc2 on its input features, forward + backward + zero_grad per step (no
optimizer: the comparison is of the sharded computation). Bytes communicated per step and rank are
counted from the collectives each implementation makes, by ``CommCounter`` (bytes each rank hands to
collectives, per kind, over one untimed step). ``local-shard`` computes one rank's share with plain
layers (fc1 with hidden / world outputs, fc2 with hidden / world inputs) and no communication, then
measures the two all-reduces the pattern cannot overlap (limits.py): the forward one of fc2's
partial outputs and the backward one of the input's partial gradients, each of tokens x d_model; its
step plus those is the limit of both rows.

    shardwise bench tp --nproc 2 --rounds 3 --steps 20
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.bench.limits import PATTERNS, synchronize, timed_collective
from shardwise.bench.sidebyside import SideBySide, bench_device
from shardwise.distributed import CommCounter
from shardwise.sharded_tensor import ChunkShardingSpec, shard_module

IMPLS = ["torch-dtensor", "shardwise-tp", "local-shard"]
PATTERN = PATTERNS["tp"]


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, cut: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d, bias=not cut)  # a row-wise cut adds the bias once

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _args(parser) -> None:
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256, help="batch x sequence, replicated")


def _prepare(impl: str, args, group):
    torch.manual_seed(0)
    world = dist.get_world_size(group)
    device = bench_device(args)
    if impl == "local-shard":
        return MLP(args.d_model, args.hidden // world, cut=True).to(device)
    mlp = MLP(args.d_model, args.hidden).to(device)
    if impl == "torch-dtensor":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = DeviceMesh(device.type, list(range(world)))
        parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    else:
        ranks = list(range(world))
        shard_module(mlp, {"fc1": ChunkShardingSpec(0, ranks), "fc2": ChunkShardingSpec(1, ranks)},
                     process_group=group)
    return mlp


def worker(impl: str, args, group: dist.ProcessGroup):
    mlp = _prepare(impl, args, group)
    device = bench_device(args)
    x = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(1))
    x = x.to(device).requires_grad_()

    def step():
        mlp(x).sum().backward()
        mlp.zero_grad(set_to_none=True)
        x.grad = None

    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if impl == "local-shard":
        partial = torch.ones(args.tokens, args.d_model, device=device)
        once = timed_collective(lambda: dist.all_reduce(partial, group=group), group, device)
        return times, {"pattern_comm_ms": round(2 * once, 2)}
    with CommCounter() as comm:
        step()
    per_step = comm.per_kind("bytes")
    out = mlp(x).detach()
    return times, {"comm_bytes_per_step": sum(per_step.values()), "by_collective": per_step,
                   "output_checksum": round(out.double().sum().item(), 3)}


BENCH = SideBySide("tp", worker, IMPLS, "torch-dtensor", _args,
                   "tensor-parallel MLP against torch's DTensor",
                   limit_rows={"torch-dtensor": "local-shard", "shardwise-tp": "local-shard"},
                   pattern=PATTERN)
