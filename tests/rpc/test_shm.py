"""The shared-memory channel: chosen between workers on one host, tensors of every shape
intact, nothing left in /dev/shm after a clean shutdown or a killed peer."""

from __future__ import annotations

import gc
import os
import resource
import socket
import threading
import time

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.current import get_agent
from shardwise.rpc.wire import frames as wire
from shardwise.rpc.wire import shm_channel, shm_ring, transport
from tests.harness import procs
from tests.rpc import helpers
from tests.rpc.conftest import ROOT, python_path
from tests.rpc.pairs import sessions, shm_pair


@pytest.fixture
def shm_world(rpc_world, rpc_channel):
    if rpc_channel != "shm":
        pytest.skip("shared-memory channel tests (run under the shm channel)")
    return rpc_world


def test_the_forced_channel_is_the_one_in_use(rpc_world, rpc_channel):
    kind = shm_channel.ShmConnection if rpc_channel == "shm" else transport.Connection
    assert all(type(c) is kind for c in get_agent().transport.conns.values())
    # and between the other two workers as well
    assert rpc.rpc_sync("worker1", helpers.channel_kinds) == [kind.__name__] * 2


def test_256_mb_tensor_over_shm(shm_world):
    big = torch.empty(64 << 20, dtype=torch.float32)  # 256 MiB
    big[::4096] = torch.arange(big[::4096].numel(), dtype=torch.float32)
    got = rpc.rpc_sync("worker1", helpers.identity, args=(big,))
    assert got.shape == big.shape and torch.equal(got, big)
    got.add_(1)  # the received tensor's memory is ours to write
    assert torch.equal(got[::4096], big[::4096] + 1)
    del got, big


def test_noncontiguous_zero_dim_and_odd_tensors_over_shm(shm_world):
    cases = [torch.arange(600_000, dtype=torch.float64).reshape(600, 1000).t()[::3],  # >256 KB
             torch.arange(24.0).reshape(4, 6).t(),  # small, non-contiguous
             torch.tensor(3.25), torch.tensor(7, dtype=torch.int64),  # 0-dim
             torch.empty(0, 5), torch.ones(3, dtype=torch.bfloat16),
             torch.randn(70_000).to(torch.complex64)[1:]]  # offset view over a segment size
    got = rpc.rpc_sync("worker1", helpers.identity, args=(cases,))
    for want, have in zip(cases, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want)


def test_large_buffers_beyond_the_pool_go_in_segments_and_held_ones_stay_intact(shm_world):
    # 20 x 16 MB received at once and all held: more than the 256 MB pool, so the sender
    # lends what fits and writes the rest into segments of their own.
    lent0, segments0 = rpc.rpc_sync("worker1", helpers.shm_sent, args=("worker0",))
    got = rpc.rpc_sync("worker1", helpers.many_large, args=(20, 4 << 20))
    again = rpc.rpc_sync("worker1", helpers.many_large, args=(3, 4 << 20))  # pool still full
    lent, segments = rpc.rpc_sync("worker1", helpers.shm_sent, args=("worker0",))
    assert lent - lent0 == 16 and segments - segments0 == 7  # 16 x 16 MB fit in 256 MB
    for i, t in enumerate(got):
        assert t.shape == (4 << 20,) and bool((t == i).all())
    assert [bool((t == i).all()) for i, t in enumerate(again)] == [True] * 3
    del got, again
    gc.collect()  # the regions go back to the sender's pool: these fit again
    assert all(bool((t == i).all()) for i, t in enumerate(
        rpc.rpc_sync("worker1", helpers.many_large, args=(8, 4 << 20))))
    assert rpc.rpc_sync("worker1", helpers.shm_sent, args=("worker0",)) == (lent + 8, segments)


def test_frames_through_a_ring_smaller_than_them_arrive_in_order(shm_world):
    # 3 MB payloads of pickled Python objects (not tensor buffers) stream through the 4 MB
    # ring from several threads at once: flow control in both directions.
    blobs = [bytes([i]) * (3 << 20) for i in range(6)]
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        try:
            assert rpc.rpc_sync(f"worker{1 + i % 2}", helpers.identity, args=(blobs[i],)) \
                == blobs[i]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _inject(sender, raw: bytes) -> None:
    """Write raw bytes into the sender's ring, as a broken or hostile peer could."""
    sender._written = sender.tx.copy_in(sender._written, memoryview(raw))
    sender.tx.publish(sender._written)
    sender.sock.send(b"D")


def _wait_consumed(sender, timeout: float = 60.0) -> None:
    """Return once the reader has released every byte written to the sender's ring."""
    deadline = time.monotonic() + timeout
    while sender.tx.words[shm_ring._READ] != sender._written:
        assert time.monotonic() < deadline, "the reader stopped taking bytes from the ring"
        time.sleep(0.01)


def test_frames_from_the_ring_are_checked_like_socket_frames():
    lost: list = []
    done = threading.Event()
    sender, reader = shm_pair(lambda *_: None, lambda peer, exc, clean: (lost.append(exc),
                                                                        done.set()))
    _inject(sender, b"XXXX" + bytes(12))
    assert done.wait(10)
    assert isinstance(lost[0], wire.FrameError) and "magic" in str(lost[0])
    sender.close()
    for conn in (sender, reader):
        conn.join(10)
    assert not shm_ring.leftover(reader.link.prefix)


def test_a_huge_claimed_payload_allocates_nothing_until_its_bytes_arrive():
    got: list = []
    lost: list = []
    sender, reader = shm_pair(lambda peer, payload, bufs: got.append(bytes(payload)),
                           lambda peer, exc, clean: lost.append((exc, clean)))
    blob = bytes(range(256)) * 40_000  # 10 MB through a 4 MB ring
    sender.send(blob, [])
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [blob]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _inject(sender, wire._FIXED.pack(wire.MAGIC, 0, (1 << 32) - 1) + b"a few bytes")
    _wait_consumed(sender)  # the reader took the header and the bytes after it
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50 << 10  # KB: < 50 MB
    sender.close()
    reader.join(10)
    assert lost and lost[0][1] is False  # closed inside a frame: not a clean close


def test_forced_shm_and_forced_tcp_cannot_meet():
    a, b = socket.socketpair()
    out: dict = {}
    ends = dict(zip((True, False), sessions()))

    def side(sock, mode, acceptor) -> None:
        try:
            out[mode] = shm_channel.negotiate(sock, mode, acceptor, 5.0, ends[acceptor], 0)
        except shm_channel.ChannelError as exc:
            out[mode] = exc

    threads = [threading.Thread(target=side, args=(a, "shm", True)),
               threading.Thread(target=side, args=(b, "tcp", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(out["shm"], shm_channel.ChannelError)
    assert "tcp" in str(out["shm"])


def test_auto_falls_back_to_tcp_when_the_peer_is_on_another_host(monkeypatch):
    a, b = socket.socketpair()
    out: dict = {}
    real = shm_channel.boot_id
    ends = dict(zip((True, False), sessions()))

    def side(sock, acceptor) -> None:
        out[acceptor] = shm_channel.negotiate(sock, "auto", acceptor, 5.0, ends[acceptor], 0)

    # the acceptor reports another kernel's boot id
    monkeypatch.setattr(shm_channel, "boot_id",
                        lambda: bytes(16 * [7]) if threading.current_thread().name == "acc"
                        else real())
    threads = [threading.Thread(target=side, args=(a, True), name="acc"),
               threading.Thread(target=side, args=(b, False), name="con")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {True: None, False: None}


def test_a_segment_that_is_not_private_is_refused(tmp_path):
    name = f"{shm_ring.PREFIX}test-{os.getpid()}-open"
    fd = os.open(shm_ring.path_of(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)
    os.ftruncate(fd, 4096)
    os.close(fd)
    with pytest.raises(shm_ring.SegmentError, match="not a private file"):
        shm_ring.open_mapped(name, 4096)
    assert not shm_ring.leftover(name)  # refused, and unlinked all the same
    fd = shm_ring.create_file(name)
    os.ftruncate(fd, 100)
    os.close(fd)
    with pytest.raises(shm_ring.SegmentError, match="holds 100 bytes"):
        shm_ring.open_mapped(name, 4096)


def _scenario(mode: str, pool_mb: str = "256") -> dict[str, str]:
    # `python -m tests.rpc.shm_scenario MODE`, started by tests/harness/procs.py
    program = procs.start(["-m", "tests.rpc.shm_scenario", mode], dict(
        os.environ, SHARDWISE_RPC_SHM_POOL_MB=pool_mb, PYTHONPATH=python_path(),
        OMP_NUM_THREADS="1"), ROOT, merge_stderr=False)
    try:
        stdout, stderr = program.communicate(timeout=120)
    finally:
        program.kill()
    assert program.returncode == 0, stdout + stderr
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


def test_clean_shutdown_leaves_no_segment(rpc_channel):
    if rpc_channel != "shm":
        pytest.skip("shared-memory channel test")
    got = _scenario("clean")
    assert got["channel"] == "ShmConnection"
    assert got["echoed"] == "True"
    assert got["callee exit"] == "0"
    assert got["left"] == "[]"


@pytest.mark.parametrize("pool_mb", ["256", "0"])  # large buffers lent from the pool, or
def test_killed_peer_fails_pending_calls_and_leaves_no_segment(rpc_channel, pool_mb):
    if rpc_channel != "shm":  # ... each in a segment of its own (names that a crash could leave)
        pytest.skip("shared-memory channel test")
    got = _scenario("kill", pool_mb)
    assert got["channel"] == "ShmConnection"
    assert got["pending"] == "True ['WorkerDied']"  # no timeout: the peer's death ended them
    assert got["failed within timeout"] == "True"
    assert got["shutdown"] == "WorkerDied"
    assert got["callee exit"] == "3"
    assert got["left"] == "[]"
