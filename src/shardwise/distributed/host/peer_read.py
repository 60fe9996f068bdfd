"""Copying tensor bytes straight out of a peer rank's memory on this host (Linux only).

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
"""

from __future__ import annotations

import os
import secrets

import torch
import torch.distributed as dist

from shardwise.distributed.env import flag_var
from shardwise.distributed.host import libc

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
