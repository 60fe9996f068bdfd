"""The collectives ZeRO uses, in one place, each on flat buffers over an explicit group.

- After the local optimizer step, updated parameters reach every rank by broadcasts from their
  owners: a parameter of at least a chunk's size in place, smaller ones coalesced into flat
  chunks (one collective per chunk rather than one per tensor), all issued asynchronously
  (gloo runs them on its own threads), each as soon as its owner has stepped it
  (``step_and_broadcast``); with ``parameters_as_bucket_view`` one broadcast per owner's flat
  buffer.
- Stage 2 reduce-scatters each gradient bucket to its owners with :class:`OwnerScatter`
  (see [Note: stage 2 buckets] in stage2.py).
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
from shardwise.dp.buckets import Bucket, Waitable
from shardwise.dp.fast_collectives import Pending
from shardwise.dp.shm_reduce import ShmReducer, usable
from shardwise.zero.shm_ring import ALIGN_BYTES, RegionRing, ring_capacity


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


Part = tuple[int, int]  # (start, end) elements of a bucket; start == end: empty


class OwnerScatter:
    """Sums each gradient bucket over ``group`` into its owners' parts: rank r receives the sum
    of every rank's ``bucket.buffer[parts[r]]`` (a reduce-scatter with parts of any size, some
    empty). The collective, chosen once for the group:

    - ranks on one host (CPU, [Note: same-host shared-memory reduction] in dp/shm_reduce.py):
      the bucket is filled in (or, when its region was still being read, copied into) its region
      of a ring of shared memory holding up to ``ring`` times the largest bucket ([Note: stage 2
      shared-memory ring] in shm_ring.py), and each rank sums its own part of every rank's
      region (``ShmReducer.launch_scatter``); no socket. A launched bucket costs no memory of its
      own there (its buffer is the region, its result the owner's gradients), so the buckets in
      flight need no bound (``bounds_in_flight`` is False);
    - NCCL: ``dist.reduce_scatter`` of the parts;
    - otherwise (gloo across hosts, or /dev/shm too small): one ``dist.reduce`` per owner with a
      part in the bucket, to that owner. gloo has a ``reduce_scatter`` that takes parts of
      unequal sizes, but it is slower than an all-reduce of the whole bucket, while the reduces
      move only each part to its owner.

    Construction is collective (it decides the shared-memory path on every rank together).
    """

    def __init__(self, group: dist.ProcessGroup, buckets: Sequence[Bucket], ring: float = 3):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.nccl = self.world > 1 and dist.get_backend(group) == "nccl"
        self.shm: ShmReducer | None = None
        self.ring: RegionRing | None = None
        dtypes = {b.params[0].dtype for b in buckets}
        if self.world > 1 and not self.nccl and len(dtypes) == 1:
            device, dtype = buckets[0].params[0].device, dtypes.pop()
            align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            capacity = ring_capacity([b.numel for b in buckets], ring, align)
            if usable(group, device, [(capacity, dtype)]):
                self.shm = ShmReducer([(capacity, dtype)], group)
                self.ring = RegionRing(buckets, capacity, align)
                whole = self.shm.buffer(0)
                self._regions = [whole[slice(*self.ring.region(b.index))] for b in buckets]

    @property
    def bounds_in_flight(self) -> bool:
        """Whether launched buckets hold memory of their own until finished (not on the
        shared-memory path), so that their number in flight should be bounded."""
        return self.shm is None

    def slot_for(self, bucket: Bucket) -> torch.Tensor | None:
        """The shared-memory region ``bucket`` is reduced from, to be filled in place, when it
        may be filled now ([Note: stage 2 shared-memory ring]). None otherwise (or without
        shared memory): the bucket is filled privately and copied into its region at launch."""
        if self.shm is None or not self.ring.may_fill(bucket.index, self._holds,
                                                      self.shm.read_through):
            return None
        return self._regions[bucket.index]

    def _holds(self, index: int) -> bool:
        """Whether bucket ``index`` is being filled in its region."""
        buffer = self.ring.buckets[index].buffer
        return buffer is not None and buffer.data_ptr() == self._regions[index].data_ptr()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()

    def launch(self, bucket: Bucket, parts: Sequence[Part], out: torch.Tensor | None
               ) -> Waitable | None:
        """Start the reduction of ``bucket`` (its buffer filled); once waited for, ``out``
        (this rank's part, None when empty) holds the sum. On one rank nothing happens: the
        bucket is the sum."""
        if self.world == 1:
            return None  # the bucket is the sum
        if self.shm is not None:
            return self._launch_shm(bucket, parts[self.rank], out)
        buffer = bucket.buffer
        if self.nccl:
            empty = buffer[:0]
            work = dist.reduce_scatter(out if out is not None else empty,
                                       [buffer[s:e] for s, e in parts], group=self.group,
                                       async_op=True)
            return work
        works = [dist.reduce(buffer[s:e], dst=global_rank(self.group, r), group=self.group,
                             async_op=True) for r, (s, e) in enumerate(parts) if e > s]
        start, end = parts[self.rank]
        land = (lambda: out.copy_(buffer[start:end])) if out is not None else None
        return Pending(works, land)

    def _launch_shm(self, bucket: Bucket, part: Part, out: torch.Tensor | None) -> Waitable:
        index, region = bucket.index, self._regions[bucket.index]
        if bucket.buffer.data_ptr() != region.data_ptr():  # filled privately: copy it over
            if any(self._holds(j) for j in self.ring.overlaps[index]):  # rule 2 prevents it
                raise RuntimeError(f"ZeRO stage 2: bucket {index}'s shared-memory region is "
                                   "held by a bucket launched after it")
            # once every rank has read what the region last held
            self.shm.wait_read_through(self.ring.last_posted(index), index)
            region.copy_(bucket.buffer)
        bucket.release()  # the region holds it now
        start, (lo, hi) = self.ring.starts[index], part
        work = self.shm.launch_scatter(0, (start + lo, start + hi) if hi > lo else (0, 0), out)
        self.ring.last_seq[index] = work.seq
        return work


def gather_to(obj: Any, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Every rank's ``obj`` (pickled) on rank ``dst``, in rank order; ``None`` elsewhere."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    out: list[Any] | None = [None] * world if me == dst else None
    dist.gather_object(obj, out, dst=global_rank(group, dst), group=group)
    return out
