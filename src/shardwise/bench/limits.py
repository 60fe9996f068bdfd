"""The physical limit of a strategy's step, and the pieces that measure it in the same run.

A strategy's limit is what no implementation of its pattern can beat on this machine: the step
of one process doing the same per-rank computation with no communication at all (a ``local-*``
row of the benchmark, run in the same interleaved rounds), plus the communication the pattern
cannot overlap with computation, measured by that local row on the same ranks and sizes with
the collectives our implementation issues. Per strategy (the text of docs/benchmarks.md says
the same):

- DDP and ZeRO (stages 1, 2): the row's own wait at the end of backward for its last buckets
  (``exposed_comm_ms`` from our bucketer; nothing computes after the last gradient arrives).
- FSDP: the root unit's all-gather (the first of forward: nothing to compute before it) and its
  reduce-scatter (the last of backward: its gradients arrive last).
- HSDP: the same two within a shard group, plus the root shard's all-reduce across replicas.
- Tensor parallelism (Megatron MLP): the forward all-reduce of the row-wise output and the
  backward all-reduce of the input's gradient (each sits between two dependent matmuls).
- Pipeline: the schedule's fill and drain. With per-stage busy times b_k over m micro-batches
  the critical path computes sum_k b_k / m + (m - 1) / m * max_k b_k, plus the slowest stage's
  optimizer step, plus one activation and one gradient transfer per stage boundary.

``limit_figures`` in sidebyside.py combines them into the record's ``limits``; ``PATTERNS``
says the same per benchmark (the records and docs/benchmarks.md carry these texts).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.dp.fast_collectives import all_gather_flat, reduce_scatter_flat

_BUCKETS = ("each row's own wait at the end of backward for its last buckets (exposed_comm_ms, "
            "from our bucketer{}: nothing computes after the last gradient arrives); the local "
            "row (local-adamw) is each rank's world-size-1 step")
PATTERNS = {
    "ddp": _BUCKETS.format(""),
    "zero": _BUCKETS.format(", ZeRO-2's included"),
    "fsdp": ("the root unit's all-gather (the first of forward: nothing to compute before it) "
             "and its reduce-scatter (the last of backward: its gradients arrive last), with our "
             "FSDP's collectives, measured by local-fsdp (whole-model forward and backward, AdamW "
             "over 1/world of the elements)"),
    "mesh": ("the root unit's all-gather and reduce-scatter within a shard group and, for HSDP, "
             "the root shard's all-reduce across replicas, measured by local-hsdp / local-full "
             "(whole-model forward and backward, AdamW over 1/shard of the elements)"),
    "tp": ("the forward all-reduce of fc2's partial outputs and the backward all-reduce of the "
           "input's partial gradients (tokens x d_model each: each sits between two dependent "
           "matrix products), measured by local-shard (one rank's share of the MLP, plain)"),
    "pipeline": ("the schedule's fill and drain: sum of the stages' busy times / m + (m - 1) / m "
                 "x the slowest stage's (each measured alone), the slowest optimizer step, and "
                 "one activation and one gradient transfer per stage boundary"),
}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a wall time is the work's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_collective(run: Callable[[], None], group: dist.ProcessGroup, device: torch.device,
                     repeats: int = 7) -> float:
    """Median milliseconds of ``run()`` (a collective that returns when done), each call
    started together on every rank (a barrier first); the slowest rank's time."""
    run()  # warm: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times) * 1e3], dtype=torch.float64,
                        device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return round(float(mine.item()), 2)


def root_numel(model: torch.nn.Module) -> int:
    """Elements of the root unit when every block is its own unit (the rest of the model)."""
    in_blocks = {id(p) for p in model.blocks.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)


def fsdp_pattern_ms(numel: int, shard_group: dist.ProcessGroup, device: torch.device,
                    replicate_group: dist.ProcessGroup | None = None) -> float:
    """The root unit's all-gather plus its gradients' reduce-scatter over ``shard_group`` (and
    the shard's all-reduce over ``replicate_group`` for HSDP), with our FSDP's collectives."""
    world = dist.get_world_size(shard_group)
    n = -(-numel // world)
    shard = torch.ones(n, device=device)
    full = torch.ones(n * world, device=device)
    ms = timed_collective(lambda: all_gather_flat(full, shard, group=shard_group), shard_group,
                          device)
    ms += timed_collective(lambda: reduce_scatter_flat(shard, full, group=shard_group),
                           shard_group, device)
    if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
        ms += timed_collective(lambda: dist.all_reduce(shard, group=replicate_group),
                               replicate_group, device)
    return round(ms, 2)


class ShardedStepStandIn:
    """The optimizer work of one rank of a sharded strategy, without its communication: AdamW
    over 1/``shards`` of every parameter (a tensor of that many elements per parameter, with a
    gradient that stays set). ``zero_grad`` clears the full model's gradients, as a step does."""

    def __init__(self, model: torch.nn.Module, shards: int, device: torch.device, **adamw):
        self.model = model
        self.shards = []
        for p in model.parameters():
            t = torch.zeros(-(-p.numel() // shards), device=device, requires_grad=True)
            t.grad = torch.full_like(t, 1e-3)
            self.shards.append(t)
        self.opt = torch.optim.AdamW(self.shards, **({"lr": 1e-3} | adamw))

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def pipeline_critical_path_ms(busy_ms: list[float], optimizer_ms: list[float],
                              microbatches: int) -> float:
    """Computation on a GPipe / 1F1B step's critical path, from each stage's busy time (all its
    micro-batches' forwards and backwards, measured alone) and its optimizer step."""
    m = microbatches
    return sum(busy_ms) / m + (m - 1) / m * max(busy_ms) + max(optimizer_ms)


def boundary_transfers_ms(shape: tuple[int, ...], group: dist.ProcessGroup,
                          device: torch.device, repeats: int = 7) -> float:
    """One activation forward and one gradient back across every stage boundary, one boundary
    at a time: the sum over boundaries of the median round trip (rank k to k+1 and back)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    buf = torch.ones(shape, device=device)
    total = 0.0
    for k in range(world - 1):
        times = []
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if rank == k:
                dist.send(buf, ranks[k + 1], group=group)
                dist.recv(buf, ranks[k + 1], group=group)
            elif rank == k + 1:
                dist.recv(buf, ranks[k], group=group)
                dist.send(buf, ranks[k], group=group)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        mine = torch.tensor([statistics.median(times[1:]) * 1e3 if rank == k else 0.0],
                            dtype=torch.float64,
                            device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        total += float(mine.item())
    return round(total, 2)
