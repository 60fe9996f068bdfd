"""Notes through shared memory ([Note: notes through shared memory], distributed/host/peers.py):
values arrive with their sequence number, waiters wake when a note comes late, and a wait fails with
a message naming the rank when that rank exited, never answers, or is out of step."""

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.distributed.host import peers as shm_notes
from shardwise.distributed.host.peers import NoteBoard
from tests.harness import run_on_ranks

pytestmark = pytest.mark.skipif(not shm_notes.supported(), reason="needs Linux on x86-64")


def _board(ctx, slots=3, timeout=None):
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid(), group=ctx.group)
    return NoteBoard(slots, ctx.group, pids, "test board", "NO_SUCH_VAR", timeout)


def _wait_asleep(pids, timeout=60.0):
    """Return once each process's main thread sleeps in a futex wait (wait_note's; it posted
    its notes first, without sleeping), or after ``timeout`` s (then the order is not forced)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all("futex" in Path(f"/proc/{pid}/wchan").read_text() for pid in pids):
                return
        except OSError:
            return  # no /proc/<pid>/wchan here: the order is not forced
        time.sleep(0.01)


def _every_pair(ctx, late: bool):
    board = _board(ctx)
    if late and ctx.rank == 0:  # the others are already waiting in the kernel
        _wait_asleep([pid for r, pid in enumerate(board.pids) if r != ctx.rank])
    for seq in (1, 2):
        for r in range(ctx.world_size):
            if r != ctx.rank:
                board.post(2, r, seq, 1000 * ctx.rank + r, -seq)
        got = {}
        for s in range(ctx.world_size):
            if s != ctx.rank:
                got[s] = board.wait_note(2, s, seq, "test")
                board.ack(2, s, seq)
        for r in range(ctx.world_size):
            if r != ctx.rank:
                board.wait_ack(2, r, seq, "test")
        assert got == {s: (1000 * s + ctx.rank, -seq) for s in got}


@pytest.mark.parametrize("late", [False, True], ids=["posted-first", "waited-first"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_notes_reach_every_rank_with_their_values(world_size, late):
    run_on_ranks(world_size, _every_pair, late)


def _exited_peer(ctx):
    board = _board(ctx)
    if ctx.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        board.pids[1] = child.pid  # rank 1 "is" a process that has exited
        with pytest.raises(RuntimeError, match="rank 1 of the group exited"):
            board.wait_note(0, 1, 1, "test")


def test_a_wait_for_a_rank_that_exited_fails_naming_it():
    run_on_ranks(2, _exited_peer)


def _silent_peer(ctx):
    board = _board(ctx, timeout=timedelta(seconds=0.3))
    if ctx.rank == 0:
        with pytest.raises(RuntimeError, match=r"rank 1 of the group did not answer within"):
            board.wait_note(1, 1, 1, "test")
    dist.barrier(group=ctx.group)


def test_a_wait_for_a_note_never_posted_times_out_naming_the_rank():
    run_on_ranks(2, _silent_peer)


def _out_of_step(ctx):
    board = _board(ctx)
    if ctx.rank == 1:
        board.post(0, 0, 2, 7, 7)
    dist.barrier(group=ctx.group)
    if ctx.rank == 0:
        with pytest.raises(RuntimeError, match="rank 1 of the group is at note 2 where this rank "
                                               "expects 1"):
            board.wait_note(0, 1, 1, "test")


def test_a_note_beyond_the_expected_one_is_an_error():
    run_on_ranks(2, _out_of_step)
