"""What ``shardwise bench --device cuda`` adds to each rank's figures.

Every row: the rank's CUDA peak memory (``torch.cuda.max_memory_allocated``). The local row
(no communication of its own) also measures how much communication overlaps computation on one
device's streams: an all-reduce of 25 MiB (a DDP bucket) issued asynchronously (NCCL runs it on
its own stream) while the default stream runs matrix products of about the same duration.
``overlap`` = (compute alone + all-reduce alone - both together) / the shorter of the two: 1
when the shorter one is hidden entirely, 0 when they run one after the other. With one GPU the
all-reduce has one rank (NCCL still runs its kernel), so this is the overlap the device's
streams allow, the limit any data-parallel schedule on it works against.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

_BUCKET_ELEMENTS = 25 * (1 << 20) // 4
_SIDE = 2048


def cuda_figures(group: dist.ProcessGroup, overlap: bool) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    figures = {"cuda_peak_mib": round(torch.cuda.max_memory_allocated(device) / (1 << 20), 1)}
    if overlap:
        figures["stream_overlap"] = stream_overlap(group, device)
    return figures


def _seconds(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def stream_overlap(group: dist.ProcessGroup, device: torch.device) -> dict:
    bucket = torch.ones(_BUCKET_ELEMENTS, device=device)
    a = torch.randn(_SIDE, _SIDE, device=device)

    def reduce():
        dist.all_reduce(bucket, group=group)

    comm_s = _seconds(reduce, device)
    one_mm = _seconds(lambda: a @ a, device)
    count = max(1, round(comm_s / max(one_mm, 1e-6)))

    def compute():
        for _ in range(count):
            a @ a

    compute_s = _seconds(compute, device)

    def both():
        work = dist.all_reduce(bucket, group=group, async_op=True)
        compute()
        work.wait()

    dist.barrier(group=group)
    both_s = _seconds(both, device)
    hidden = (compute_s + comm_s - both_s) / min(compute_s, comm_s)
    return {"allreduce_ms": round(comm_s * 1e3, 3), "compute_ms": round(compute_s * 1e3, 3),
            "both_ms": round(both_s * 1e3, 3), "overlap": round(max(0.0, min(1.0, hidden)), 3)}
