"""JSON values exchanged between ranks (never pickle: nothing a peer sends can run code).

Every function is a collective over ``group`` when torch.distributed is initialized, and a
local no-op otherwise (one process, no group), or when ``group`` is ``NO_DIST`` (one process
working alone inside a distributed job, as torch DCP's ``no_dist=True``).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

NO_DIST: Any = object()  # a "group" meaning: this process alone, no collective


def active(group: dist.ProcessGroup | None) -> bool:
    return group is not NO_DIST and dist.is_available() and dist.is_initialized()


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not active(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_json(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order. Collective: two all-gathers
    (the lengths, then the bytes padded to the longest)."""
    if not active(group):
        return [json.loads(json.dumps(obj))]
    world = dist.get_world_size(group)
    data = json.dumps(obj).encode()
    device = _device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [json.loads(bytes(o[: int(n)].cpu().numpy())) for o, n in zip(out, sizes)]


def barrier(group: dist.ProcessGroup | None) -> None:
    if active(group):
        dist.barrier(group=group)


def any_true(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` is true on any rank (one all-reduce)."""
    if not active(group):
        return flag
    t = torch.tensor([int(flag)], device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
