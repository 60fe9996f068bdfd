"""Reading a peer's memory ([Note: reading a peer's memory], distributed/host/peers.py): the
bytes come back exactly, a failed read names the process, and a rank cannot send its peers to read a
process other than itself."""

import errno
import multiprocessing
import os

import pytest
import torch

from shardwise.distributed.host import peers as peer_read
from shardwise.distributed.host.peers import DISABLE_VAR, PeerReadError, peer_pids, read_into
from tests.harness import peer_reads_permitted, run_on_ranks

pytestmark = pytest.mark.skipif(peer_read._READ is None, reason="process_vm_readv needs Linux")
needs_permission = pytest.mark.skipif(not peer_reads_permitted(),
                                      reason="this host forbids reading a sibling's memory")


def _hold(conn, values):
    """A child that keeps ``values`` in its memory until told to exit."""
    t = torch.tensor(values, dtype=torch.float64)
    conn.send(t.data_ptr())
    conn.recv()


@needs_permission
def test_read_into_copies_the_bytes_of_another_process():
    values = [float(i) * 0.25 - 3 for i in range(1000)]
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_hold, args=(there, values))
    child.start()
    try:
        address = here.recv()
        dest = torch.empty(1000, dtype=torch.float64)
        read_into(dest, child.pid, address)
        assert torch.equal(dest, torch.tensor(values, dtype=torch.float64))
        with pytest.raises(PeerReadError, match=f"process {child.pid}"):
            read_into(dest, child.pid, 8)  # an address nothing is mapped at
    finally:
        here.send(None)
        child.join()
    with pytest.raises(PeerReadError, match=f"process {child.pid} failed"):
        read_into(dest, child.pid, address)  # the process has exited


def test_read_into_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        read_into(torch.empty(4, 4).t(), os.getpid(), 0)


def _pids(ctx):
    return peer_pids(ctx.group), os.getpid()


@needs_permission
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_learns_every_ranks_process_id(world_size):
    results = run_on_ranks(world_size, _pids)
    truth = [pid for _, pid in results]
    assert all(pids == truth for pids, _ in results)


def _one_rank_lies(ctx, victim: int):
    """Rank 1 claims another process's id (the test runner's): its peers must not believe it."""
    real = os.getpid
    if ctx.rank == 1:
        os.getpid = lambda: victim
    try:
        return peer_pids(ctx.group)
    finally:
        os.getpid = real


@needs_permission
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_claiming_another_process_is_not_believed(world_size):
    """The claimed process holds no echo of the peers' fresh challenges, so every rank falls
    back to gloo; without the challenge the peers would read (and sum into their gradients)
    whatever lies at that address of the test runner's memory."""
    assert run_on_ranks(world_size, _one_rank_lies, os.getpid()) == [None] * world_size


def _refused(ctx, refusing_rank: int):
    """One rank's reads fail as Yama or a container's seccomp profile would make them fail."""
    real = peer_read._READ

    def denied(*args):
        return -1, errno.EPERM

    if ctx.rank == refusing_rank:
        peer_read._READ = denied
    try:
        return peer_pids(ctx.group)
    finally:
        peer_read._READ = real


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_rank_refused_turns_the_path_off_for_all(world_size):
    assert run_on_ranks(world_size, _refused, world_size - 1) == [None] * world_size


def _disabled(ctx):
    if ctx.rank == 0:
        os.environ[DISABLE_VAR] = "1"
    try:
        return peer_pids(ctx.group)
    finally:
        os.environ.pop(DISABLE_VAR, None)


def test_the_environment_variable_turns_it_off_for_all():
    assert run_on_ranks(2, _disabled) == [None, None]
