"""The ranks of one host working with each other's memory: reading it, and short notes about it.

``peer_pids`` and ``read_into`` copy tensor bytes straight out of a peer rank's memory (Linux
only); a ``NoteBoard`` carries the short notes that say where those bytes are and that a reader
is done with them, through one shared segment and futex wake-ups (Linux on x86-64).

[Note: reading a peer's memory]
Between two ranks on one host, gloo moves a tensor through loopback TCP: the sender's kernel
copies it into socket buffers, the receiver's kernel copies it out, and both sides pay for the
TCP stack and gloo's wake-ups in between. Linux's ``process_vm_readv`` copies bytes from another
process's memory into ours in one step, and the sender spends nothing on it. The kernel allows
it only where we could attach to that process as a debugger: same user, and no stricter policy
(Yama's ``ptrace_scope`` of 1 or more forbids it between sibling processes, which torchrun's
ranks are; seccomp profiles of some containers refuse the call). Where it is refused, the
callers keep gloo.

``peer_pids`` decides, once for a group, whether every rank may read every other rank's memory,
and learns their process ids. A peer's claimed process id is checked before it is believed:
each rank draws a random challenge, the ranks all-gather the challenges, each keeps the whole
list in its memory and all-gathers ``(process id, address of that list)``, and each rank reads
every peer's list at the claimed address and checks that its own challenge is there. Only the
peer itself holds this rank's fresh challenge, so a rank cannot send its peers to read another
process's memory. Every rank's verdict is then all-reduced, so either all ranks read each other
or none does.

``read_into`` copies one contiguous run of bytes; a read that fails or comes back short is an
error naming the process (a peer that exited, an address that is not mapped).
``SHARDWISE_NO_PEER_READ=1`` turns the path off.

[Note: notes through shared memory]
Where ranks read each other's memory ([Note: reading a peer's memory] above), what they still
have to tell each other is small: "the bytes for you are at this address" and "I am done
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

A receiver that sees the sequence number also sees the values written before it where the
machine keeps stores in order ([Note: memory ordering on one host], segment.py): the board is
used on x86-64 only.
A waiter wakes at least every 50 ms to check that the rank it waits for still exists (a rank
that exited fails the wait at once, naming it, as a reset connection would on gloo), and raises
after the timeout. A sequence number beyond the one expected means the ranks issued different
notes (different backward passes): an error, not a silent pairing of the wrong notes.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.distributed.env import flag_var
from shardwise.distributed.host import libc
from shardwise.distributed.host.segment import (
    SharedSegment,
    process_alive,
    room_for,
    stores_in_order,
)
from shardwise.distributed.timeouts import default_timeout

DISABLE_VAR = "SHARDWISE_NO_PEER_READ"
_MAX_READ = 1 << 30  # bytes per call: the kernel caps one read near 2 GiB


class PeerReadError(RuntimeError):
    """A read from a peer's memory failed (the peer exited, or its address was wrong)."""


# libc's ``process_vm_readv`` (libc.py), or None where there is none (not Linux, an old libc)
_READ = libc.read_peer if libc.can_read_peers() else None


def read_into(dest: torch.Tensor, pid: int, address: int) -> None:
    """Fill ``dest`` (contiguous, CPU) with the bytes at ``address`` in process ``pid``."""
    if not dest.is_contiguous() or dest.device.type != "cpu":
        raise ValueError("read_into needs a contiguous CPU tensor")
    nbytes = dest.numel() * dest.element_size()
    if _READ is None:
        raise PeerReadError("reading another process's memory needs Linux")
    done = 0
    while done < nbytes:
        size = min(_MAX_READ, nbytes - done)
        got, err = _READ(pid, dest.data_ptr() + done, address + done, size)
        if got != size:
            why = os.strerror(err) if err else f"{max(got, 0)} of {size} bytes"
            raise PeerReadError(f"reading {size} bytes at {address + done:#x} of process {pid} "
                                f"failed: {why} (has that rank exited?)")
        done += size


def peer_pids(group: dist.ProcessGroup, enabled: bool = True) -> list[int] | None:
    """The process id of each rank of ``group`` where every rank may read every other rank's
    memory (see the Note), else None. Collective: two all-gathers of a few bytes and an
    all-reduce, on every rank of the group; ``enabled`` is this rank's own precondition (every
    rank on this host), which any rank's False turns off for all."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    challenge = torch.tensor(list(secrets.token_bytes(16)), dtype=torch.uint8)
    challenges = [torch.empty_like(challenge) for _ in range(world)]
    dist.all_gather(challenges, challenge, group=group)
    echo = torch.stack(challenges)  # every rank's challenge, held in this process's memory
    claim = torch.tensor([os.getpid(), echo.data_ptr()], dtype=torch.int64)
    claims = [torch.empty_like(claim) for _ in range(world)]
    dist.all_gather(claims, claim, group=group)
    ok = enabled and _READ is not None and not flag_var(DISABLE_VAR)
    if ok:
        ok = all(_answers(claims[r], rank, challenge) for r in range(world) if r != rank)
    verdict = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)  # also: every read is done
    del echo
    return [int(c[0]) for c in claims] if verdict.item() else None


def _answers(claim: torch.Tensor, rank: int, challenge: torch.Tensor) -> bool:
    """Whether the process ``claim`` names holds this rank's challenge where it says."""
    pid, address = int(claim[0]), int(claim[1])
    seen = torch.empty_like(challenge)
    try:
        read_into(seen, pid, address + rank * challenge.numel())
    except PeerReadError:
        return False
    return torch.equal(seen, challenge)


# ---- notes between the ranks ----------------------------------------------------------------
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
        self._pause = libc.pause(_LIVENESS_S)  # each sleep's bound (read only: shared)

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
        while (seen := int(word[field])) < seq:
            libc.futex_wait(address, seen & 0xFFFFFFFF, self._pause)
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

