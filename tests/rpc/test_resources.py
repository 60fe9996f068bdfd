"""What a peer can cost a worker is bounded ([Note: bounded frames] in wire.py, [Note: bounded
acceptor] in transport.py), and shutdown() leaves nothing of the agent behind."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import struct
import termios
import threading
import time

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.wire import MAGIC, send_frame
from shardwise.rpc.wire.auth import HELLO_SIZE, address_of, connect_handshake, new_token
from shardwise.rpc.wire.shm_channel import negotiate
from shardwise.rpc.wire.transport import HANDSHAKE_SLOTS, RateLimitedLog, Transport
from tests.rpc import helpers
from tests.rpc.scenarios import lines, run

_FIXED = struct.Struct("!4sIQ")
MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Server:
    """A transport of rank 0 in a world of 2, recording frames and lost connections. Its
    channel is TCP: the raw peer of these tests writes frames to the socket itself (frames
    that arrive through shared memory pass the same checks, tests/rpc/test_shm.py)."""

    def __init__(self, **kwargs):
        self.token = new_token()
        self.frames, self.lost = [], []
        self.sessions: dict = {}  # a joined socket's file number -> its session
        self.got = threading.Event()
        self.gone = threading.Event()
        self.t = Transport(0, 2, self.token, "127.0.0.1", self._frame, self._lost, **kwargs)
        self.t.channel = "tcp"

    def _frame(self, peer, payload, buffers):
        self.frames.append((peer, bytes(payload)))
        self.got.set()

    def _lost(self, peer, exc, clean):
        self.lost.append((peer, type(exc).__name__))
        self.gone.set()

    def join_as(self, rank: int, token: bytes | None = None) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.t.port), timeout=5)
        session = connect_handshake(sock, token or self.token, rank, 0,
                                    address_of("127.0.0.1", self.t.port))
        # the channel hello, as a TCP peer
        negotiate(sock, "tcp", acceptor=False, timeout=5, session=session, peer=0)
        self.sessions[sock.fileno()] = session
        return sock

    def conn(self, rank: int, timeout: float = 60.0):
        """The server's connection to ``rank`` once it is registered: the acceptor adds it after
        its own side of the channel hello, which may finish after the joiner's."""
        deadline = time.monotonic() + timeout
        while rank not in self.t.conns:
            assert time.monotonic() < deadline, f"rank {rank}'s connection was never registered"
            time.sleep(0.01)
        return self.t.conns[rank]


@pytest.fixture
def server():
    servers = []

    def make(**kwargs):
        servers.append(_Server(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.t.close()


def _queued(sock: socket.socket, request: int) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]


def _wait_read(sender: socket.socket, receiver: socket.socket, timeout: float = 60.0) -> None:
    """Return once every byte ``sender`` sent was read by the process behind ``receiver``:
    nothing left in the sender's queue (TIOCOUTQ) nor unread at the receiver (FIONREAD)."""
    deadline = time.monotonic() + timeout
    while _queued(sender, termios.TIOCOUTQ) or _queued(receiver, termios.FIONREAD):
        assert time.monotonic() < deadline, "the server stopped reading what was sent"
        time.sleep(0.01)


def _legit_calls(n: int = 20) -> int:
    """How many of ``n`` calls to worker1 returned the right answer (each within the pool's
    RPC timeout, or it raises)."""
    ones = torch.ones(4)
    return sum(torch.equal(rpc.rpc_sync("worker1", helpers.identity, args=(ones,)), ones)
               for _ in range(n))


def test_header_claiming_4_gib_costs_only_what_arrives(server):
    srv = server()
    sock = srv.join_as(1)
    before = _rss()
    sock.sendall(_FIXED.pack(MAGIC, 0, 4 << 30) + b"\x00" * (8 * MB))  # 8 MB of the 4 GiB
    _wait_read(sock, srv.conn(1).sock)  # all 8 MB are in the server's hands
    grown = _rss() - before
    assert grown < 100 * MB, f"{grown / MB:.0f} MB for a 4 GiB header and 8 MB of payload"
    assert srv.t.conns[1].closed is False  # still waiting for the rest
    sock.close()
    assert srv.gone.wait(5) and srv.lost == [(1, "PeerClosed")]


def test_frame_above_max_message_size_drops_the_connection(server):
    srv = server(max_message=1 << 30)
    sock = srv.join_as(1)
    before = _rss()
    sock.sendall(_FIXED.pack(MAGIC, 0, 4 << 30))
    assert srv.gone.wait(5) and srv.lost == [(1, "FrameError")]
    assert _rss() - before < 100 * MB
    sock.close()


def test_slow_handshake_ends_at_its_deadline(server):
    """One byte every 0.25 s: the whole handshake has 1 s, not 1 s per recv."""
    srv = server(handshake_timeout=1.0)
    sock = socket.create_connection(("127.0.0.1", srv.t.port), timeout=5)
    sock.recv(HELLO_SIZE)
    sent = 0
    try:
        for _ in range(40):  # 10 s of trickling if nothing stopped it
            sock.send(b"S")
            sent += 1
            time.sleep(0.25)
    except OSError:
        pass  # reset by the acceptor
    # a deadline per recv would never end it (a byte every 0.25 s): it was cut off before the
    # 40th byte, however slowly this machine runs the trickle
    assert sent < 40, "the acceptor kept a trickling handshake open"
    sock.close()


def test_second_connection_claiming_a_joined_rank_is_refused_not_the_first(server):
    srv = server()
    first = srv.join_as(1)
    deadline = time.monotonic() + 5
    while 1 not in srv.t.conns and time.monotonic() < deadline:
        time.sleep(0.01)
    second = srv.join_as(1)  # knows the secret, claims the same rank
    second.settimeout(5)
    assert second.recv(1) == b""  # closed by the acceptor
    send_frame(first, b"still here", [], srv.sessions[first.fileno()])
    assert srv.got.wait(5) and srv.frames == [(1, b"still here")]
    assert srv.lost == []
    first.close()
    second.close()


def test_rejections_are_rate_limited(caplog):
    limited = RateLimitedLog(every=60)
    with caplog.at_level(logging.WARNING, logger="shardwise.rpc"):
        logged = [limited.warning("rejected %d", i) for i in range(1000)]
    assert logged.count(True) == 1 and len(caplog.records) == 1


def test_idle_connections_are_bounded_and_peers_still_served(rpc_world):
    """3,000 connections that never speak: at most HANDSHAKE_SLOTS handshakes (threads) at a
    time, the others closed at once; worker1 keeps answering its group and its memory stays
    within 100 MB of where it started."""
    threads0, fds0, rss0 = rpc.rpc_sync("worker1", helpers.resources)
    host, port = rpc.rpc_sync("worker1", helpers.listener_address)
    assert host == "127.0.0.1"  # bound to the rendezvous interface, not 0.0.0.0
    idle = []
    try:
        for _ in range(3000):
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection((host, port), timeout=5))
        threads1, fds1, rss1 = rpc.rpc_sync("worker1", helpers.resources)
        served = _legit_calls()  # while every idle connection is still open
    finally:
        for s in idle:
            s.close()
    assert threads1 <= threads0 + HANDSHAKE_SLOTS + 2
    assert fds1 <= fds0 + HANDSHAKE_SLOTS + 4
    assert rss1 - rss0 < 100 * MB
    assert served == 20  # served during the attack, not after it


def test_ten_init_shutdown_cycles_leave_nothing_behind(tmp_path):
    ranks = run("cycles", 2, extra_env={"SCENARIO_DIR": str(tmp_path)})
    for code, text in ranks:
        assert code == 0, text
        out = lines(text)
        assert out["first"] == out["last"], text  # (threads, fds) after cycle 1 and 10
        assert out["rpc port refused"] == "True", text
    assert lines(ranks[0][1])["store refused"] == "True"
