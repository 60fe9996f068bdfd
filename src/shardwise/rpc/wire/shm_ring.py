"""Shared-memory segments and the byte ring that carries RPC frames between two local peers.

[Note: shm ring] One ring per direction: a single-producer single-consumer byte stream in a
shared segment. The header holds the write cursor (bytes ever written, advanced by the one
writer) and the read cursor (bytes ever consumed, advanced by the one reader), each on its own
cache line, and two flags: ``reader_sleeping`` (the reader found nothing and is about to block
on the doorbell) and ``writer_waiting`` (the writer found the ring full). A side that changes a
cursor and then finds the other side's flag set clears it and rings the doorbell (one byte on
the connection's socket, shm_channel.py). The flag store and the cursor load on each side are
separated by a full memory fence (``Fence``, [Note: memory ordering on one host]), so either the
sleeper sees the new cursor or the other side sees the flag: no wake-up is lost. Cursors are 8-byte
aligned and written with single 8-byte stores (a ``memoryview`` cast to ``Q``), so a reader never
sees half of one.

Segments (distributed/host/segment.py) are files in /dev/shm created with ``O_EXCL`` and mode 0600
by one side and opened by the other, which checks that the file is a regular file of this user,
private, and of the expected size before it maps it, then unlinks the name: once both ends have
mapped a segment its name is gone, so a crash leaves nothing behind. Names start with the
connection's id (shm_channel.py), so the side that survives a dead peer removes whatever the peer
created and the reader never opened (:func:`remove_all`).
"""

from __future__ import annotations

import os
from pathlib import Path

# the segments themselves come from the same-host layer (its one creator); the names below are
# the ones the channel (shm_channel.py) uses
from shardwise.distributed.host.segment import SHM_DIR as _SHM_DIR
from shardwise.distributed.host.segment import Fence, SegmentError, path_of  # noqa: F401
from shardwise.distributed.host.segment import create_private as create_file  # noqa: F401
from shardwise.distributed.host.segment import map_private as map_file  # noqa: F401
from shardwise.distributed.host.segment import open_private as open_mapped  # noqa: F401
from shardwise.distributed.host.segment import unlink_private as unlink  # noqa: F401

SHM_DIR = Path(_SHM_DIR)
PREFIX = "shardwise-rpc-"
_HEADER = 4096  # the header page; data follows
_WRITE, _READ, _SLEEPING, _WAITING, _MAGIC = 8, 16, 24, 32, 0  # 8-byte word offsets
RING_MAGIC = 0x5357524E47303031  # "SWRNG001"


def write_file(fd: int, data: memoryview, at: int = 0) -> None:
    """Write all of ``data`` at offset ``at`` of the file (the kernel copies: no page faults
    here)."""
    done, total = 0, len(data)
    while done < total:
        done += os.pwrite(fd, data[done:done + (1 << 30)], at + done)


def remove_all(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; returns how many."""
    count = 0
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            path.unlink()
            count += 1
        except OSError:
            pass
    return count


def leftover(prefix: str = PREFIX) -> list[str]:
    """Names of the segments under ``prefix`` that exist now (tests check for none)."""
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*"))


class Ring:
    """One direction's ring on a mapped segment; ``capacity`` is a power of two."""

    def __init__(self, view: memoryview, capacity: int, init: bool):
        if capacity & (capacity - 1) or len(view) < _HEADER + capacity:
            raise SegmentError(f"a segment of {len(view)} bytes does not hold a ring of "
                               f"{capacity} bytes")
        self.capacity, self._mask = capacity, capacity - 1
        self._writer_fence, self._reader_fence = Fence(), Fence()
        self.words = view[:_HEADER].cast("Q")
        self.data = view[_HEADER:_HEADER + capacity]
        if init:
            self.words[_WRITE] = self.words[_READ] = 0
            self.words[_SLEEPING] = self.words[_WAITING] = 0
            self.words[_MAGIC] = RING_MAGIC
        elif self.words[_MAGIC] != RING_MAGIC:
            raise SegmentError("shared-memory ring has a bad magic number")

    @staticmethod
    def segment_size(capacity: int) -> int:
        return _HEADER + capacity

    # ------------------------------------------------------------------ writer's side
    def space(self, written: int) -> int:
        return self.capacity - (written - self.words[_READ])

    def copy_in(self, written: int, part: memoryview) -> int:
        """Copy ``part`` (which fits: see :meth:`space`) at stream offset ``written``; the
        cursor is not published. Returns the new offset."""
        n = len(part)
        at = written & self._mask
        first = min(n, self.capacity - at)
        self.data[at:at + first] = part[:first]
        if first < n:
            self.data[:n - first] = part[first:]
        return written + n

    def publish(self, written: int) -> bool:
        """Make bytes up to ``written`` visible; True if the reader must be woken."""
        self.words[_WRITE] = written
        self._writer_fence()
        if self.words[_SLEEPING]:
            self.words[_SLEEPING] = 0
            return True
        return False

    def writer_waits(self, written: int) -> bool:
        """Flag that the writer waits for space; False if space appeared meanwhile."""
        self.words[_WAITING] = 1
        self._writer_fence()
        if self.space(written) > 0:
            self.words[_WAITING] = 0
            return False
        return True

    # ------------------------------------------------------------------ reader's side
    def available(self, consumed: int) -> int:
        return self.words[_WRITE] - consumed

    def copy_out(self, consumed: int, target: memoryview) -> int:
        """Copy ``len(target)`` available bytes from stream offset ``consumed``."""
        n = len(target)
        at = consumed & self._mask
        first = min(n, self.capacity - at)
        target[:first] = self.data[at:at + first]
        if first < n:
            target[first:] = self.data[:n - first]
        return consumed + n

    def peek(self, consumed: int, have: int) -> memoryview:
        """A view of the available bytes from ``consumed`` up to the ring's end at most."""
        at = consumed & self._mask
        return self.data[at:at + min(have, self.capacity - at)]

    def release(self, consumed: int) -> bool:
        """Free the ring up to ``consumed``; True if the writer must be woken."""
        self.words[_READ] = consumed
        self._reader_fence()
        if self.words[_WAITING]:
            self.words[_WAITING] = 0
            return True
        return False

    def reader_sleeps(self, consumed: int) -> tuple[bool, bool]:
        """Free the ring up to ``consumed`` and flag that the reader is about to block (one
        fence for both). Returns (block: no data arrived meanwhile, wake the writer)."""
        words = self.words
        words[_READ] = consumed
        words[_SLEEPING] = 1
        self._reader_fence()
        wake = bool(words[_WAITING])
        if wake:
            words[_WAITING] = 0
        if words[_WRITE] != consumed:
            words[_SLEEPING] = 0
            return False, wake
        return True, wake

    def reader_awake(self) -> None:
        self.words[_SLEEPING] = 0

    def close(self) -> None:
        """Release the views (call only once no thread uses the ring)."""
        self.words.release()
        self.data.release()
