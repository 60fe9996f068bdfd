"""The collectives ZeRO uses, in one place, each on flat buffers over an explicit group.

- After the local optimizer step, updated parameters reach every rank by broadcasts from their
  owners: a parameter of at least a chunk's size in place, smaller ones coalesced into flat
  chunks (one collective per chunk rather than one per tensor), all issued asynchronously
  (gloo runs them on its own threads), each as soon as its owner has stepped it
  (``step_and_broadcast``); with ``parameters_as_bucket_view`` one broadcast per owner's flat
  buffer.
- Stage 2 delivers each gradient bucket to its owner with ``reduce_to_owner``. Buckets hold the
  parameters of a single owner (see [Note: stage 2 buckets] in stage2.py), so a per-owner
  ``dist.reduce`` fits partitions of any shape; on gloo it is also faster than a
  reduce-scatter (figures in docs/zero.md).
- State-dict consolidation gathers each rank's (small, pickled) local state to one rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.distributed.collectives import flatten, unflatten_into
from shardwise.distributed.groups import global_rank


def broadcast_chunks(chunks: Sequence[tuple[int, Sequence[torch.Tensor]]],
                     group: dist.ProcessGroup, max_in_flight: int = 3) -> None:
    """For each ``(src, tensors)``: every rank's ``tensors`` become rank ``src``'s.

    One broadcast per chunk of one dtype, flattened into a temporary buffer; at most
    ``max_in_flight`` are outstanding, which bounds the temporary memory. Every rank must pass
    the same chunks in the same order.
    """
    me = dist.get_rank(group)
    pending: deque[tuple[dist.Work, torch.Tensor, Sequence[torch.Tensor], bool]] = deque()
    for src, tensors in chunks:
        if len(pending) >= max_in_flight:
            _settle(pending.popleft())
        mine = src == me
        if mine:
            flat = flatten(tensors)
        else:
            numel = sum(t.numel() for t in tensors)
            flat = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
        work = dist.broadcast(flat, src=global_rank(group, src), group=group, async_op=True)
        pending.append((work, flat, tensors, mine))
    while pending:
        _settle(pending.popleft())


def step_and_broadcast(parts: Sequence[tuple[int, Sequence[torch.Tensor]]],
                       step: Callable[[Sequence[torch.Tensor]], None],
                       group: dist.ProcessGroup, max_in_flight: int = 4) -> None:
    """ZeRO stage 1's step overlapped with its broadcasts: for each ``(src, tensors)`` in order,
    rank ``src`` first runs ``step(tensors)`` (its optimizer on that part), then the part is
    broadcast from it, asynchronously, so that it travels while the next part is stepped.

    A part of one tensor is broadcast in place (no copy); a part of several small tensors goes
    through a flat temporary (at most ``max_in_flight`` of them alive). Every rank must pass the
    same parts in the same order (the owners' parts interleaved, so all ranks step at once).
    """
    me = dist.get_rank(group)
    pending: deque[tuple[dist.Work, torch.Tensor, Sequence[torch.Tensor], bool]] = deque()
    in_place: list[dist.Work] = []
    for src, tensors in parts:
        mine = src == me
        if mine:
            step(tensors)
        if len(tensors) == 1:
            in_place.append(dist.broadcast(tensors[0].detach(), src=global_rank(group, src),
                                           group=group, async_op=True))
            continue
        if len(pending) >= max_in_flight:
            _settle(pending.popleft())
        flat = flatten(tensors) if mine else torch.empty(
            sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        work = dist.broadcast(flat, src=global_rank(group, src), group=group, async_op=True)
        pending.append((work, flat, tensors, mine))
    for work in in_place:
        work.wait()
    while pending:
        _settle(pending.popleft())


def _settle(item: tuple[dist.Work, torch.Tensor, Sequence[torch.Tensor], bool]) -> None:
    work, flat, tensors, mine = item
    work.wait()
    if not mine:
        unflatten_into(flat, tensors)


def broadcast_buffers(buffers: Sequence[tuple[int, torch.Tensor]],
                      group: dist.ProcessGroup) -> None:
    """For each ``(src, flat)``: broadcast ``flat`` in place from rank ``src``; all issued at
    once, then waited together (parameters that are views into the buffers need no copy)."""
    works = [dist.broadcast(flat, src=global_rank(group, src), group=group, async_op=True)
             for src, flat in buffers]
    for work in works:
        work.wait()


def reduce_to_owner(buffer: torch.Tensor, owner: int, group: dist.ProcessGroup,
                    async_op: bool = True) -> dist.Work | None:
    """Sum ``buffer`` over the group into rank ``owner``'s copy (others' copies are garbage
    afterwards). The one place stage 2 says how a bucket reaches its owner."""
    return dist.reduce(buffer, dst=global_rank(group, owner), op=dist.ReduceOp.SUM,
                       group=group, async_op=async_op)


def gather_to(obj: Any, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Every rank's ``obj`` (pickled) on rank ``dst``, in rank order; ``None`` elsewhere."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    out: list[Any] | None = [None] * world if me == dst else None
    dist.gather_object(obj, out, dst=global_rank(group, dst), group=group)
    return out
