"""Short notes between the ranks of one host, through one shared mapping and futex wake-ups.

[Note: notes through shared memory]
Where ranks read each other's memory ([Note: reading a peer's memory], peer_read.py), what they
still have to tell each other is small: "the bytes for you are at this address" and "I am done
with them". Sent through gloo, each note is a message that wakes gloo's event loop on both
sides, and with every core busy computing that loop can spin on a lock a preempted thread holds
(docs/benchmarks-history.md has the measurement). A ``NoteBoard`` carries them in one shared
mapping instead: for each subject (``slot``) and each ordered pair of ranks, four 8-byte
words: the sequence number of the sender's last note, the note's two values, and the receiver's
acknowledgement of it.

- ``post`` (the sender) writes the two values, then the sequence number, then wakes any waiter
  on that word (``FUTEX_WAKE``: one system call, whether or not someone waits);
- ``wait_note`` (the receiver) returns the values once the sequence number has reached the one
  it expects, sleeping in the kernel (``FUTEX_WAIT`` on the word's low 32 bits) meanwhile;
- ``ack`` and ``wait_ack`` do the same with the acknowledgement word.

x86-64 keeps stores in program order as other cores see them, so a receiver that sees the
sequence number also sees the values written before it; the board is used on x86-64 only.
A waiter wakes at least every 50 ms to check that the rank it waits for still exists (a rank
that exited fails the wait at once, naming it, as a reset connection would on gloo), and raises
after the timeout. A sequence number beyond the one expected means the ranks issued different
notes (different backward passes): an error, not a silent pairing of the wrong notes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.distributed.host import libc
from shardwise.distributed.host.segment import (
    SharedSegment,
    process_alive,
    room_for,
    stores_in_order,
)
from shardwise.distributed.timeouts import default_timeout

_SEQ, _A, _B, _ACK = range(4)  # the words of one (slot, sender, receiver)
_LIVENESS_S = 0.05


def supported() -> bool:
    """Whether this machine can carry notes on a board (Linux on x86-64)."""
    return stores_in_order() and libc.has_futex()


def board_bytes(slots: int, world: int) -> int:
    return max(slots, 1) * world * world * 4 * 8


def room_for_board(slots: int, world: int) -> bool:
    return room_for(board_bytes(slots, world))


class NoteBoard:
    """Notes on ``slots`` subjects between the ranks of ``group`` (see the Note).

    Construction is collective (``SharedSegment``: a broadcast and a barrier). ``pids`` are the
    ranks' process ids (for the liveness check); ``purpose`` names the user in errors."""

    def __init__(self, slots: int, group: dist.ProcessGroup, pids: Sequence[int],
                 purpose: str, disable_var: str, timeout: timedelta | None = None):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.pids, self.purpose = list(pids), purpose
        self.timeout = (timeout or default_timeout()).total_seconds()
        nbytes = board_bytes(slots, self.world)
        self._segment = SharedSegment(nbytes, group, purpose, disable_var)
        self.words = self._segment.tensor(0, nbytes // 8, torch.int64).view(
            max(slots, 1), self.world, self.world, 4)
        self._base = self.words.data_ptr()

    # ---- the sender ---------------------------------------------------------------------
    def post(self, slot: int, receiver: int, seq: int, a: int, b: int) -> None:
        """Note number ``seq`` on ``slot`` for ``receiver``: the values ``(a, b)``."""
        word = self.words[slot, self.rank, receiver]
        word[_A], word[_B] = a, b
        word[_SEQ] = seq  # last: a receiver that sees it sees the values
        self._wake(slot, self.rank, receiver, _SEQ)

    def wait_ack(self, slot: int, receiver: int, seq: int, what: str) -> None:
        """Until ``receiver`` has acknowledged note ``seq`` on ``slot``."""
        self._await(slot, self.rank, receiver, _ACK, seq, receiver, what)

    # ---- the receiver -------------------------------------------------------------------
    def wait_note(self, slot: int, sender: int, seq: int, what: str) -> tuple[int, int]:
        """The values of ``sender``'s note ``seq`` on ``slot``, once it is posted."""
        self._await(slot, sender, self.rank, _SEQ, seq, sender, what)
        word = self.words[slot, sender, self.rank]
        return int(word[_A]), int(word[_B])

    def ack(self, slot: int, sender: int, seq: int) -> None:
        """Tell ``sender`` that this rank is done with its note ``seq`` on ``slot``."""
        self.words[slot, sender, self.rank, _ACK] = seq
        self._wake(slot, sender, self.rank, _ACK)

    # ---- waiting ------------------------------------------------------------------------
    def _address(self, slot: int, sender: int, receiver: int, field: int) -> int:
        index = ((slot * self.world + sender) * self.world + receiver) * 4 + field
        return self._base + 8 * index

    def _wake(self, slot: int, sender: int, receiver: int, field: int) -> None:
        libc.futex_wake(self._address(slot, sender, receiver, field))

    def _await(self, slot: int, sender: int, receiver: int, field: int, seq: int, peer: int,
               what: str) -> None:
        word = self.words[slot, sender, receiver]
        address = self._address(slot, sender, receiver, field)
        now = time.monotonic()
        deadline, next_check = now + self.timeout, now + _LIVENESS_S
        pause = libc.pause(_LIVENESS_S)
        while (seen := int(word[field])) < seq:
            libc.futex_wait(address, seen & 0xFFFFFFFF, pause)
            now = time.monotonic()
            if now < next_check or int(word[field]) >= seq:
                continue
            next_check = now + _LIVENESS_S
            if not process_alive(self.pids[peer]):
                raise RuntimeError(f"{self.purpose}: rank {peer} of the group exited while this "
                                   f"rank waited for it ({what})")
            if now > deadline:
                raise RuntimeError(f"{self.purpose}: rank {peer} of the group did not answer "
                                   f"within {self.timeout:.0f} s ({what}; a rank hangs, or the "
                                   "ranks ran different backward passes)")
        if seen > seq:
            raise RuntimeError(f"{self.purpose}: rank {peer} of the group is at note {seen} "
                               f"where this rank expects {seq} ({what}): the ranks ran different "
                               "backward passes")

    def close(self) -> None:
        self._segment.close()

