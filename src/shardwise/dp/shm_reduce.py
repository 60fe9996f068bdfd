"""Gradient buckets reduced through one shared-memory segment (ranks on one host).

[Note: same-host shared-memory reduction]
On one host, gloo's all-reduce moves every byte through loopback TCP: a copy into the kernel and
one out on each hop, on the CPU cores that also run forward and backward. With every core busy
(one rank per core), that CPU time is added to the step however well it overlaps. NCCL avoids
the socket between GPUs of one node; this module does the same for CPU ranks of one host.

Every rank maps one segment that holds, for each bucket, one slot per rank. A bucket's buffer is
the rank's own slot, so the bucketer's copy of the gradients into the bucket (already scaled by
1/world size) writes straight into shared memory. Reducing bucket ``b`` then takes two phases,
run in launch order on one worker thread per rank (torch's kernels release the GIL, so backward
goes on meanwhile):

1. when every rank has posted the bucket, rank ``r`` adds part ``r`` of every other rank's slot
   into part ``r`` of its own slot (the parts split the bucket evenly);
2. when every rank has reduced its part, rank ``r`` copies part ``k`` from rank ``k``'s slot for
   every ``k != r``, and then signals that it has finished reading.

Each part is summed by one rank only and copied by the others, so every rank ends with the same
bits. Per rank that is one read of the bucket and one write of it, against gloo's socket
traffic. ``wait()`` returns when every rank has finished reading the bucket, so the next backward
may overwrite the slots.

A reduce-scatter (``launch_scatter``, ZeRO stage 2's gradients) is the first phase alone, with
parts the caller chooses (each owner's gradients, of any sizes): rank ``r`` sums part ``r`` of
every rank's slot into a tensor of its own, outside the segment, and nothing is copied back.
Its ``wait()`` returns as soon as this rank's sum is done, without waiting for the others to
finish reading: the slot is free for its next bucket only once every rank has read it
(``slot_free`` tells without blocking, ``wait_slot`` blocks; ``read_through`` and
``wait_read_through`` do the same for a posting's sequence number, for a user that places
several buckets in one slot), which its user checks before writing into it again, so no rank
waits for a peer's sum in the middle of backward.

Synchronisation uses three int64 words per rank (posted, reduced, read), each written only by
its owner with the bucket's sequence number (a fourth holds the rank's process id: a waiter
checks every 50 ms that the ranks it waits for still exist, and fails at once, naming them,
when one has exited, as a reset connection would on gloo). A peer that sees the word also sees
the data written before it where the machine keeps stores in order ([Note: memory ordering on
one host], distributed/host/segment.py): the path is used on x86-64 only (elsewhere the plain
all-reduce runs). A waiter polls briefly and then sleeps with a growing back-off (the cores are
busy with compute; it must not spin); after the group's timeout it raises an error naming the
ranks that never arrived.

The segment (``SharedSegment``, distributed/host/segment.py) is created by rank 0 in ``/dev/shm``
with mode 0600 under a random name, which is broadcast as bytes (nothing is unpickled); every rank
maps it, and after a barrier rank 0 unlinks it, so a crash later leaves nothing behind. Its pages
are reserved when it is made (``posix_fallocate``), and the path is taken only where /dev/shm has
room for it, so a small /dev/shm (a container's) means the plain all-reduce, never a bus error when
a page is first touched. ``SHARDWISE_NO_SHM_REDUCE=1`` turns the path off.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.distributed.env import flag_var
from shardwise.distributed.host.same_host import on_one_host
from shardwise.distributed.host.segment import (
    SharedSegment,
    process_alive,
    room_for,
    stores_in_order,
)
from shardwise.distributed.timeouts import default_timeout

DISABLE_VAR = "SHARDWISE_NO_SHM_REDUCE"
Step = Callable[[torch.Tensor], object]  # element-wise work on a part of the result, in place
_ALIGN = 64  # bytes: slots and words start on their own cache line
_WORDS = 4  # posted, reduced, read; the rank's process id
_POSTED, _REDUCED, _READ, _PID = range(_WORDS)
_LIVENESS_S = 0.05  # how often a waiter checks that the ranks it waits for still exist


def usable(group: dist.ProcessGroup, device: torch.device,
           layouts: Sequence[tuple[int, torch.dtype]]) -> bool:
    """Whether :class:`ShmReducer` may serve ``group`` for buckets ``layouts`` on ``device``.

    Collective (every rank must call it): CPU tensors, x86-64, more than one rank, not turned
    off by the environment, room for the segment in /dev/shm (a container's is often 64 MB),
    and every rank on this host.
    """
    return on_one_host(group, device, lambda: (
        stores_in_order() and not flag_var(DISABLE_VAR)
        and room_for(segment_bytes(layouts, dist.get_world_size(group)))))


def segment_bytes(layouts: Sequence[tuple[int, torch.dtype]], world: int) -> int:
    """Bytes of the segment for buckets ``layouts`` among ``world`` ranks."""
    return _aligned(world * _WORDS * _ALIGN) + sum(
        world * _aligned(numel * torch.empty((), dtype=dtype).element_size())
        for numel, dtype in layouts)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmReducer:
    """Averaging all-reduce of fixed buckets through shared memory (see the Note above).

    ``layouts`` are ``(numel, dtype)`` per bucket, the same on every rank. :meth:`buffer` gives
    the rank's own slot of bucket ``i``, a 1D tensor the caller fills (already scaled) before
    :meth:`launch`. Launches must come in the same order on every rank, as for a collective.
    Construction is collective over ``group`` (a broadcast and a barrier).
    """

    def __init__(self, layouts: Sequence[tuple[int, torch.dtype]], group: dist.ProcessGroup,
                 timeout: timedelta | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = (timeout or default_timeout()).total_seconds()
        offset = _aligned(self.world * _WORDS * _ALIGN)
        self._slots: list[list[tuple[int, int, torch.dtype]]] = []
        for numel, dtype in layouts:
            size = _aligned(numel * torch.empty((), dtype=dtype).element_size())
            self._slots.append([(offset + r * size, numel, dtype) for r in range(self.world)])
            offset += self.world * size
        assert offset == segment_bytes(layouts, self.world)
        self._segment = SharedSegment(offset, group, "shared-memory gradient reduction",
                                      DISABLE_VAR)
        stride = _ALIGN // 8
        words = self._segment.tensor(0, self.world * _WORDS * stride, torch.int64)
        self._words = words.view(self.world, _WORDS, stride)[:, :, 0]
        self._views = [[self._segment.tensor(o, n, d) for o, n, d in slots]
                       for slots in self._slots]
        self._words[self.rank, _PID] = os.getpid()
        dist.barrier(group=group)  # every rank's process id is in place
        self._seq = int(self._words[self.rank, _POSTED])  # 0 in a fresh segment
        self._slot_seq = [0] * len(layouts)  # per slot, the sequence number last posted in it
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="shardwise-shm-reduce",
                                        daemon=True)
        self._worker.start()

    def buffer(self, index: int) -> torch.Tensor:
        """This rank's slot of bucket ``index`` (1D, the bucket's numel)."""
        return self._views[index][self.rank]

    def launch(self, index: int, finish: Step | None = None) -> ShmWork:
        """Post bucket ``index`` (its slot is filled) and reduce it in the background.

        ``finish(part)`` runs on the worker thread on the part this rank sums, after the sum
        and before the others read it: element-wise work on the result, off the thread that
        launches ([Note: compression on one host] in ddp/compressed.py)."""
        return self._post(ShmWork(self, index, finish))

    def _post(self, work: ShmWork) -> ShmWork:
        if self._closed:
            raise RuntimeError("shared-memory reducer used after close()")
        self._seq += 1
        work.seq = self._slot_seq[work.index] = self._seq
        self._words[self.rank, _POSTED] = self._seq
        self._jobs.put(work)
        return work

    def launch_scatter(self, index: int, part: tuple[int, int],
                       out: torch.Tensor | None) -> ShmWork:
        """Post slot ``index`` (filled) and reduce-scatter it in the background: ``out`` (this
        rank's part, ``part = (start, end)`` in elements; None when it is empty) becomes the sum
        over ranks of their slots' ``[start:end]``, in rank order. The ranks' parts may differ in
        size and need not cover the slot. Nothing is written to shared memory but the words:
        rank r reads every rank's part r and then says it has read ([Note: same-host
        shared-memory reduction]). ``wait()`` returns once ``out`` holds the sum; the slot may
        be written again after :meth:`wait_slot` (or while :meth:`slot_free`)."""
        start, end = part
        if end > start and (out is None or out.numel() != end - start):
            raise ValueError(f"launch_scatter: out must hold the part's {end - start} elements")
        work = ShmWork(self, index)
        work.part, work.out = part, out
        return self._post(work)

    def slot_free(self, index: int) -> bool:
        """Whether every rank has finished reading what was last posted in slot ``index``
        (this rank may write into it again); does not block."""
        return self.read_through(self._slot_seq[index])

    def wait_slot(self, index: int) -> None:
        """Until every rank has finished reading what was last posted in slot ``index``."""
        self.wait_read_through(self._slot_seq[index], index)

    def read_through(self, seq: int) -> bool:
        """Whether every rank has finished reading every posting up to sequence number ``seq``
        (``ShmWork.seq``; each rank reads in posting order); does not block."""
        return int(self._words[:, _READ].min()) >= seq

    def wait_read_through(self, seq: int, index: int) -> None:
        """Until :meth:`read_through` ``(seq)``; ``index`` names the slot in a timeout's error."""
        self._await(_READ, seq, index)

    def close(self) -> None:
        """Stop the worker thread and drop the mapping (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
        self._views, self._words = [], None
        self._segment.close()

    # ------------------------------------------------------------ worker thread
    def _run(self) -> None:
        while True:
            work = self._jobs.get()
            if work is None:
                return
            try:
                self._reduce(work)
            except BaseException as exc:  # handed to the waiter, never lost on this thread
                work.error = exc
            work.done.set()

    def _reduce(self, work: ShmWork) -> None:
        if work.part is not None:
            self._scatter(work)
            return
        index, seq = work.index, work.seq
        slots, r = self._views[index], self.rank
        self._await(_POSTED, seq, index)
        own = self._parts(slots[r])
        for k in range(self.world):
            if k != r:
                own[r].add_(self._parts(slots[k])[r])
        if work.finish is not None:
            work.finish(own[r])
        self._words[r, _REDUCED] = seq
        self._await(_REDUCED, seq, index)
        for k in range(self.world):
            if k != r:
                own[k].copy_(self._parts(slots[k])[k])
        self._words[r, _READ] = seq

    def _scatter(self, work: ShmWork) -> None:
        index, seq = work.index, work.seq
        start, end = work.part
        if end > start:
            self._await(_POSTED, seq, index)
            parts = [slot[start:end] for slot in self._views[index]]
            torch.add(parts[0], parts[1], out=work.out)
            for part in parts[2:]:
                work.out.add_(part)
        self._words[self.rank, _REDUCED] = seq
        self._words[self.rank, _READ] = seq

    def _parts(self, slot: torch.Tensor) -> list[torch.Tensor]:
        base, extra = divmod(slot.numel(), self.world)
        sizes = [base + (1 if k < extra else 0) for k in range(self.world)]
        return list(slot.split(sizes))

    def _await(self, word: int, seq: int, index: int) -> None:
        """Until every rank's ``word`` reaches ``seq``; a named error after the timeout."""
        column = self._words[:, word]
        deadline = time.monotonic() + self.timeout
        pause, next_check = 0.0, time.monotonic() + _LIVENESS_S
        while int(column.min()) < seq:
            now = time.monotonic()
            if now > next_check:
                self._check_alive(column, seq, index)
                next_check = now + _LIVENESS_S
            if now > deadline:
                late = [k for k in range(self.world) if int(column[k]) < seq]
                stage = ("posted", "reduced its part of", "read")[word]
                raise RuntimeError(
                    f"shared-memory gradient reduction: rank(s) {late} of the group have not "
                    f"{stage} bucket {index} after {self.timeout:.0f} s (a rank died, hangs, or "
                    "runs a different number of backward passes)")
            time.sleep(pause)
            pause = min(2e-4, pause * 2 if pause else 1e-5)

    def _check_alive(self, column: torch.Tensor, seq: int, index: int) -> None:
        """Fail fast, as a reset connection would on gloo, when a rank waited for is gone."""
        dead = [k for k in range(self.world)
                if int(column[k]) < seq and not process_alive(int(self._words[k, _PID]))]
        if dead:
            raise RuntimeError(f"shared-memory gradient reduction: rank(s) {dead} of the group "
                               f"exited while the others waited for them at bucket {index}")

    def wait_read(self, work: ShmWork) -> None:
        """Until every rank has finished reading ``work``'s bucket (its slots may change)."""
        self._await(_READ, work.seq, work.index)


class ShmWork:
    """One launched bucket reduction; ``wait()`` returns when every rank has read it (an
    all-reduce), or when this rank's part is summed (a reduce-scatter: see ``launch_scatter``)."""

    def __init__(self, reducer: ShmReducer, index: int, finish: Step | None = None):
        self.reducer, self.index, self.seq = reducer, index, 0  # seq: set when posted
        self.finish = finish
        self.part: tuple[int, int] | None = None  # a reduce-scatter's part (launch_scatter)
        self.out: torch.Tensor | None = None
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        if self.part is None:
            self.reducer.wait_read(self)
        return True
