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

from shardwise.distributed.collectives import all_gather_bytes
from shardwise.distributed.groups import collective_device

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
    return [json.loads(b) for b in all_gather_bytes(json.dumps(obj).encode(), group)]


def barrier(group: dist.ProcessGroup | None) -> None:
    if active(group):
        dist.barrier(group=group)


def any_true(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` is true on any rank (one all-reduce)."""
    if not active(group):
        return flag
    t = torch.tensor([int(flag)], device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
