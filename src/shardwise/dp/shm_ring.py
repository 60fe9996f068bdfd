"""All-gathers and reduce-scatters of any size through a small ring of shared-memory slots.

[Note: same-host shared-memory ring]
FSDP moves every unit's parameters twice per step (the forward and the backward gather): on one
host over gloo that is loopback TCP, a copy into the kernel and one out of it per hop, on the
cores that also compute ([Note: same-host shared-memory reduction] in shm_reduce.py says why
that costs the step). Unlike DDP's buckets, a unit's buffers are large and many, so giving each
one a place in shared memory would cost as much memory again as the model; the ring instead
moves a collective in pieces through ``slots`` fixed slots per rank (``slot_bytes`` each), reused
round-robin, so the segment stays a few MB per rank whatever the model's size.

Every piece of every collective gets the next sequence number ``s`` (the same on every rank:
collectives are issued in the same order everywhere) and lives in slot ``s % slots``:

1. rank r waits until every rank has finished reading what that slot held before (piece
   ``s - slots``), copies its piece into its own slot and posts ``s``;
2. once every rank has posted ``s``, it reads every rank's slot: an all-gather copies each
   rank's piece to where it belongs (the caller says where: ``deliver``), a reduce-scatter sums
   part r of every rank's slot into its output; then it says it has read ``s``.

A rank posts up to ``slots`` pieces ahead of the one it reads, so the ranks rarely wait for one
another inside a collective. All of it runs in order on one worker thread per rank (torch's
copies release the GIL, so the caller computes meanwhile); ``wait()`` returns when this rank has
read the collective's last piece. Each posted piece also carries a key (the collective's kind,
size and piece number): a rank that finds another key in a peer's slot raises an error naming
both, instead of mixing pieces of different collectives.

Synchronisation words, process-id liveness checks, timeouts, the segment's creation (0600, a
random name, unlinked once mapped, pages reserved) and the x86-64-only rule are those of
shm_reduce.py. ``SHARDWISE_NO_SHM_REDUCE=1`` turns this path off too.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.distributed.timeouts import default_timeout
from shardwise.dp.shm_reduce import Segment, await_all, usable

SLOT_BYTES = 2 << 20  # per rank and slot, at most (see slot_size)
MIN_SLOT_BYTES = 64 << 10
SLOTS = 8
_ALIGN = 64
_POSTED, _READ, _PID, _WORDS = 0, 1, 2, 3  # per rank, each on its own cache line
Deliver = Callable[[int, int, torch.Tensor], None]  # (rank, first element, piece): place it


def slot_size(largest: int) -> int:
    """Bytes per slot for collectives of at most ``largest`` bytes per rank: the power of two
    that holds them, within [64 KiB, 2 MiB] (small models keep a small segment)."""
    size = MIN_SLOT_BYTES
    while size < min(largest, SLOT_BYTES):
        size *= 2
    return size


def ring_usable(group: dist.ProcessGroup, device: torch.device, slot_bytes: int) -> bool:
    """Whether a :class:`ShmRing` with ``slot_bytes`` per slot may serve ``group`` on
    ``device`` (collective: every rank calls it). The conditions of shm_reduce's ``usable``."""
    return usable(group, device, [(SLOTS * slot_bytes, torch.uint8)])


class ShmRing:
    """All-gathers and reduce-scatters over ``group`` through shared memory (see the Note).
    Construction is collective (a broadcast and two barriers); so is every call, which must
    come in the same order on every rank."""

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int = SLOT_BYTES,
                 slots: int = SLOTS, timeout: timedelta | None = None):
        self.group, self.rank = group, dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.slot_bytes, self.slots = slot_bytes, slots
        self.timeout = (timeout or default_timeout()).total_seconds()
        head = self.world * _WORDS * _ALIGN + self.world * slots * _ALIGN  # words, keys
        self._segment = Segment(head + self.world * slots * slot_bytes, group)
        stride = _ALIGN // 8
        words = self._segment.tensor(0, self.world * _WORDS * stride, torch.int64)
        self._words = words.view(self.world, _WORDS, stride)[:, :, 0]
        keys = self._segment.tensor(self.world * _WORDS * _ALIGN, self.world * slots * stride,
                                    torch.int64)
        self._keys = keys.view(self.world, slots, stride)[:, :, 0]
        self._data = [[self._segment.tensor(head + (r * slots + j) * slot_bytes, slot_bytes,
                                            torch.uint8) for j in range(slots)]
                      for r in range(self.world)]
        self._words[self.rank, _PID] = os.getpid()
        dist.barrier(group=group)  # every rank's process id is in place
        self._seq = 0  # the last sequence number handed out (a fresh segment's words are 0)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="shardwise-shm-ring",
                                        daemon=True)
        self._worker.start()

    # ---- the collectives ----------------------------------------------------------------
    def all_gather(self, source: torch.Tensor, deliver: Deliver) -> RingWork:
        """Every rank's ``source`` (1D, contiguous, the same numel and dtype everywhere) goes
        to every rank: ``deliver(k, start, piece)`` is called on the worker thread with rank
        k's elements ``[start, start + piece.numel())`` (this rank's own included, straight
        from ``source``); ``piece`` is valid only during the call."""
        per = self.slot_bytes // source.element_size()
        pieces = [(a, min(a + per, source.numel())) for a in range(0, source.numel(), per)]
        return self._submit(_Gather(source, deliver, pieces, per))

    def reduce_scatter(self, out: torch.Tensor | None, parts: Sequence[torch.Tensor],
                       average: bool = False) -> RingWork:
        """``out`` (1D, ``parts[rank].numel()`` elements; None when that is 0) becomes the sum
        (the mean with ``average``) over ranks of their ``parts[rank]``. ``parts``: one 1D
        tensor per destination rank, of the same dtype; part k has the same numel on every
        rank. The parts are read on the worker thread: leave them alone until ``wait()``."""
        if len(parts) != self.world:
            raise ValueError(f"reduce_scatter: {len(parts)} parts for {self.world} ranks")
        n = parts[self.rank].numel()
        if n and (out is None or out.numel() != n):
            raise ValueError(f"reduce_scatter: out must hold this rank's {n} elements")
        per = self.slot_bytes // parts[0].element_size() // self.world
        longest = max(p.numel() for p in parts)
        pieces = [(a, min(a + per, longest)) for a in range(0, longest, per)]
        return self._submit(_Scatter(out, list(parts), pieces, per, average))

    def close(self) -> None:
        """Stop the worker thread and drop the mapping (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
        self._data, self._words, self._keys = [], None, None
        self._segment.close()

    def _submit(self, job: _Job) -> RingWork:
        if self._closed:
            raise RuntimeError("shared-memory ring used after close()")
        job.first = self._seq + 1
        self._seq += len(job.pieces)
        self._jobs.put(job)
        return job.work

    # ---- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._move(job)
            except BaseException as exc:  # handed to the waiter, never lost on this thread
                job.work.error = exc
            job.work.done.set()

    def _move(self, job: _Job) -> None:
        """Post up to ``slots`` pieces ahead of the one read; see the Note."""
        posted = read = 0
        n = len(job.pieces)
        while read < n:
            while posted < n and posted - read < self.slots and (
                    posted == read or self._slot_free(job.first + posted)):
                self._post(job, posted)
                posted += 1
            seq = job.first + read
            self._wait(_POSTED, seq, "posted")
            key = job.key(read)
            slot = seq % self.slots
            for k in range(self.world):
                if int(self._keys[k, slot]) != key:
                    raise RuntimeError(
                        f"shared-memory ring: rank {k} posted another collective than rank "
                        f"{self.rank} at piece {seq} (ranks must issue the same all-gathers "
                        f"and reduce-scatters in the same order; this rank: {job.describe()})")
            job.read(read, [self._data[k][slot] for k in range(self.world)], self.rank)
            self._words[self.rank, _READ] = seq
            read += 1

    def _slot_free(self, seq: int) -> bool:
        return int(self._words[:, _READ].min()) >= seq - self.slots

    def _post(self, job: _Job, index: int) -> None:
        seq = job.first + index
        self._wait(_READ, seq - self.slots, "read")
        slot = seq % self.slots
        job.write(index, self._data[self.rank][slot], self.rank)
        self._keys[self.rank, slot] = job.key(index)
        self._words[self.rank, _POSTED] = seq

    def _wait(self, word: int, seq: int, stage: str) -> None:
        await_all(self._words[:, word], seq, self._words[:, _PID], self.timeout,
                  f"shared-memory ring: rank(s) {{late}} of the group have not {stage} piece "
                  f"{seq} after {self.timeout:.0f} s (a rank died, hangs, or issued other "
                  "collectives)",
                  "shared-memory ring: rank(s) {dead} of the group exited while the others "
                  f"waited for them at piece {seq}")


class RingWork:
    """One collective of the ring; ``wait()`` returns once this rank has read all of it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Job:
    """A collective cut into pieces: what rank r writes into its slot, and reads from all."""

    kind = 0

    def __init__(self, pieces: list[tuple[int, int]]):
        self.pieces, self.first, self.work = pieces, 0, RingWork()

    def key(self, index: int) -> int:
        a, b = self.pieces[index]
        return zlib.crc32(f"{self.kind}:{len(self.pieces)}:{index}:{a}:{b}".encode()) + 1

    def describe(self) -> str:
        raise NotImplementedError

    def write(self, index: int, slot: torch.Tensor, rank: int) -> None:
        raise NotImplementedError

    def read(self, index: int, slots: list[torch.Tensor], rank: int) -> None:
        raise NotImplementedError


class _Gather(_Job):
    kind = 1

    def __init__(self, source: torch.Tensor, deliver: Deliver, pieces, per: int):
        super().__init__(pieces)
        self.source, self.deliver, self.per = source, deliver, per

    def describe(self) -> str:
        return f"all-gather of {self.source.numel()} {self.source.dtype} elements"

    def _view(self, slot: torch.Tensor, index: int) -> torch.Tensor:
        a, b = self.pieces[index]
        return slot.view(self.source.dtype)[: b - a]

    def write(self, index: int, slot: torch.Tensor, rank: int) -> None:
        a, b = self.pieces[index]
        self._view(slot, index).copy_(self.source[a:b])

    def read(self, index: int, slots: list[torch.Tensor], rank: int) -> None:
        a, b = self.pieces[index]
        for k, slot in enumerate(slots):
            piece = self.source[a:b] if k == rank else self._view(slot, index)
            self.deliver(k, a, piece)


class _Scatter(_Job):
    kind = 2

    def __init__(self, out: torch.Tensor | None, parts: list[torch.Tensor], pieces, per: int,
                 average: bool):
        super().__init__(pieces)
        self.out, self.parts, self.per, self.average = out, parts, per, average

    def describe(self) -> str:
        sizes = [p.numel() for p in self.parts]
        return f"reduce-scatter of parts {sizes} {self.parts[0].dtype}"

    def write(self, index: int, slot: torch.Tensor, rank: int) -> None:
        a, b = self.pieces[index]
        rows = slot.view(self.parts[0].dtype)
        for k, part in enumerate(self.parts):
            n = max(0, min(b, part.numel()) - a)
            if n:
                rows[k * self.per : k * self.per + n].copy_(part[a : a + n])

    def read(self, index: int, slots: list[torch.Tensor], rank: int) -> None:
        a, b = self.pieces[index]
        n = max(0, min(b, self.parts[rank].numel()) - a)
        if not n:
            return
        start = rank * self.per
        mine = [s.view(self.parts[0].dtype)[start : start + n] for s in slots]
        dest = self.out[a : a + n]
        torch.add(mine[0], mine[1], out=dest)
        for other in mine[2:]:
            dest.add_(other)
        if self.average:
            dest.div_(len(slots))
