"""A pool of shared memory per direction in which large buffers are handed to the peer.

[Note: shm pool] The sender of a large tensor copies it once into a free region of its pool
(mapped by both ends, its pages stay allocated between messages, so the copy costs no page
allocation), marks the region's slot as lent and tells the reader (slot, offset) in the
frame. The reader wraps the region as the received array without a copy; when that array (and
so every tensor rebuilt on it) is freed, a finalizer clears the slot, and the sender may reuse
the region. A peer that keeps received tensors keeps their regions: when no region is free the
sender falls back to a segment of its own for the message (shm_channel.py), so nothing waits.
Pages beyond the first ``KEEP`` bytes are given back when the sender finds nothing lent and
none of them was used for ``IDLE`` seconds.

The slot words live in the pool's first page: 1 = lent to the reader, 0 = free; only the
sender sets 1 and only the reader sets 0. The reader checks every descriptor (slot in range
and lent, region inside the pool, page aligned, not already held by another of its arrays), so
a peer cannot make two received tensors share memory. (A peer of the same user on the same
host can write into memory it lent, as it could write into this process through /proc; the
RPC trusts its authenticated peers' data, not their code.)
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

PAGE = 4096
SLOTS = 256
KEEP = 80 << 20  # pool bytes whose pages stay allocated while nothing is lent
IDLE = 2.0  # seconds without a region beyond KEEP before its pages are given back
_now = time.monotonic
_SLOT0 = 8  # word index of slot 0 in the header page


class PoolError(ValueError):
    """A pool descriptor from the peer does not name a region it lent."""


def pool_bytes(size: int) -> int:
    """Bytes of a pool segment (header page + data) holding ``size`` data bytes."""
    return PAGE + size if size else 0


class PoolWriter:
    """The sender's side: first-fit regions over the pool, reclaimed once the reader frees."""

    def __init__(self, view: memoryview, size: int,
                 drop: Callable[[int, int], None] | None = None):
        self.size = size
        self.words = view[:PAGE].cast("Q")
        self.data = np.frombuffer(view, np.uint8, size, PAGE) if size else None
        self._live: dict[int, tuple[int, int]] = {}  # slot -> (offset, bytes), lent
        self._lock = threading.Lock()
        self._drop = drop  # gives the pages of a data range back to the system
        self._touched = 0  # data bytes below this may hold pages
        self._high_at = 0.0  # when a region last reached beyond KEEP

    def _trim(self) -> None:
        """With nothing lent and no region beyond ``KEEP`` for ``IDLE`` seconds, keep the
        first ``KEEP`` bytes' pages (warm for the next large message) and give the rest back,
        so a burst does not hold memory for good (giving them back between messages of a
        busy stream would make every message pay the page allocation again)."""
        if not self._live and self._touched > KEEP and self._drop is not None \
                and _now() - self._high_at > IDLE:
            self._drop(KEEP, self._touched - KEEP)
            self._touched = KEEP

    def alloc(self, n: int) -> tuple[int, int] | None:
        """A free region of ``n`` bytes as (slot, offset), marked lent; None if none is."""
        if self.data is None or n > self.size:
            return None
        with self._lock:
            for slot in [s for s in self._live if self.words[_SLOT0 + s] == 0]:
                del self._live[slot]  # the reader freed it
            self._trim()
            if len(self._live) == SLOTS:
                return None
            offset = self._first_fit(-(-n // PAGE) * PAGE)
            if offset is None:
                return None
            slot = next(s for s in range(SLOTS) if s not in self._live)
            self._live[slot] = (offset, n)
            self._touched = max(self._touched, offset + n)
            if offset + n > KEEP:
                self._high_at = _now()
            self.words[_SLOT0 + slot] = 1
            return slot, offset

    def _first_fit(self, n: int) -> int | None:
        at = 0
        for offset, used in sorted(self._live.values()):
            if offset - at >= n:
                return at
            at = max(at, offset + -(-used // PAGE) * PAGE)
        return at if self.size - at >= n else None

    def write(self, offset: int, view: memoryview) -> None:
        """Copy ``view`` into the region at ``offset`` (numpy lets go of the GIL meanwhile);
        PoolError once the pool is closed (its connection closed while a sender copies)."""
        data = self.data
        if data is None:
            raise PoolError("the pool is closed: its connection closed")
        np.copyto(data[offset:offset + len(view)], np.frombuffer(view, np.uint8))

    def close(self) -> None:
        self.words.release()
        self.data = None


class PoolReader:
    """The reader's side: descriptors become arrays over the peer's pool."""

    def __init__(self, view: memoryview, size: int):
        self.size = size
        self._view = view
        self.words = view[:PAGE].cast("Q")
        self._held: set[int] = set()

    def take(self, slot: int, offset: int, n: int) -> np.ndarray:
        """The lent region as an array that frees its slot when it is freed."""
        if not 0 <= slot < SLOTS or offset % PAGE or offset < 0 or offset + n > self.size:
            raise PoolError(f"pool region out of range: slot {slot}, offset {offset}, {n} bytes "
                            f"in a pool of {self.size}")
        if slot in self._held or self.words[_SLOT0 + slot] != 1:
            raise PoolError(f"pool slot {slot} is not lent to this reader")
        self._held.add(slot)
        arr = np.frombuffer(self._view, np.uint8, n, PAGE + offset)
        weakref.finalize(arr, _free, self.words, self._held, slot)
        return arr


def _free(words: memoryview, held: set[int], slot: int) -> None:
    held.discard(slot)
    words[_SLOT0 + slot] = 0
