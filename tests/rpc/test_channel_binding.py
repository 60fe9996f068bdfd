"""Issue 25 point 4: a connection is bound to its handshake. A relay without the group secret
that forwards the handshake can neither finish it from another port nor speak on the
connection: an injected, replayed or changed frame closes the connection with a warning naming
the peer, and nothing in it reaches the agent; other connections keep working."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from shardwise.rpc.messages import ENVELOPE, Kind
from shardwise.rpc.wire import auth, shm_channel
from shardwise.rpc.wire import frames as wire
from shardwise.rpc.wire.auth import AuthError, new_token
from shardwise.rpc.wire.transport import Transport
from tests.rpc.pairs import shm_pair, tcp_pair
from tests.rpc.relay import Relay

HOST = "127.0.0.1"


class _Worker:
    """One transport and what reached its agent."""

    def __init__(self, rank: int, world: int, token: bytes):
        self.frames: list = []
        self.lost: list = []
        self.got, self.gone = threading.Event(), threading.Event()
        self.t = Transport(rank, world, token, HOST, self._frame, self._lost,
                           handshake_timeout=5.0)
        self.t.channel = "tcp"

    def _frame(self, peer, payload, buffers):
        self.frames.append((peer, bytes(payload)))
        self.got.set()

    def _lost(self, peer, exc, clean):
        self.lost.append((peer, type(exc).__name__, str(exc)))
        self.gone.set()

    def wait_frames(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.frames) < n and time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.fixture
def workers():
    made: list[_Worker] = []

    def make(world: int = 3):
        token = new_token()
        made.extend(_Worker(r, world, token) for r in range(world))
        return made

    yield make
    for w in made:
        w.t.close(join_timeout=5)


def _call_frame(text: bytes) -> bytes:
    """A well-formed frame (no valid tag) asking for a call: what a relay would inject."""
    payload = ENVELOPE.pack(Kind.CALL, 7) + text
    return b"".join(bytes(p) for p in wire.frame_parts(payload, [])) + bytes(wire.TAG)


def test_a_relay_on_another_port_cannot_finish_the_handshake(workers, caplog):
    """The address record pointed at the relay: the connector's proof names the address it
    dialed, which is not the acceptor's, so the acceptor refuses; the real address works."""
    victim, peer, _ = workers()
    relay = Relay((HOST, victim.t.port))
    with caplog.at_level(logging.WARNING, logger="shardwise.rpc"), \
            pytest.raises(AuthError, match="rank 0"):
        peer.t.connect(0, HOST, relay.port, timeout=5)
    assert 1 not in victim.t.conns
    assert any("a relay between them" in r.getMessage() for r in caplog.records)
    relay.close()
    peer.t.connect(0, HOST, victim.t.port, timeout=5)  # the true address still connects
    peer.t.send(0, b"honest", [])
    victim.wait_frames(1)
    assert victim.frames == [(1, b"honest")]


@pytest.mark.parametrize("attack", ["inject", "replay", "flip"])
def test_an_on_path_relay_cannot_speak_on_the_connection(workers, caplog, attack):
    """A relay the acceptor is reached through (its address is the relay's, as behind a
    proxy) forwards the whole handshake and the channel hellos; then it injects a call frame,
    re-sends the connector's first frame, or flips a byte of it. The acceptor closes that
    connection and logs why; the frame never reaches the agent; rank 2's direct connection
    keeps working."""
    victim, peer, other = workers()
    relay = Relay((HOST, victim.t.port))
    victim.t.port = relay.port  # the address the acceptor believes it is reached at
    start = len(_handshake_bytes(HOST, relay.port))
    if attack == "flip":
        relay.flip_at = start + 20  # a byte of the first frame's payload
    with caplog.at_level(logging.WARNING, logger="shardwise.rpc"):
        peer.t.connect(0, HOST, relay.port, timeout=5)
        peer.t.send(0, ENVELOPE.pack(Kind.CALL, 1) + b"legitimate", [])
        assert victim.gone.wait(10) if attack == "flip" else _first_then_attack(
            victim, relay, attack, start)
    assert victim.lost and victim.lost[0][:2] == (1, "FrameError")
    assert "fails its MAC" in victim.lost[0][2]
    delivered = [p for _, p in victim.frames]
    assert all(b"attacker" not in p for p in delivered)
    assert len(delivered) == (0 if attack == "flip" else 1)
    assert any("closing the connection to rank 1" in r.getMessage()
               and "fails its MAC" in r.getMessage() for r in caplog.records)
    # the honest path: rank 2 connects to the acceptor's real port and is served
    _connect_direct(other, victim)
    other.t.send(0, b"still served", [])
    deadline = time.monotonic() + 10
    while (2, b"still served") not in victim.frames and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (2, b"still served") in victim.frames
    relay.close()


def _handshake_bytes(host: str, port: int) -> bytes:
    """What the connector sends before its first frame: its handshake reply and its sealed
    channel hello."""
    address = auth.address_of(host, port)
    return bytes(auth._REPLY.size + len(address) + 32 + shm_channel._HELLO.size + wire.TAG)


def _first_then_attack(victim: _Worker, relay: Relay, attack: str, start: int) -> bool:
    victim.wait_frames(1)
    assert len(victim.frames) == 1
    raw = _call_frame(b"attacker's arguments") if attack == "inject" \
        else bytes(relay.c2a[start:])
    relay.inject(raw)
    return victim.gone.wait(10)


def _connect_direct(other: _Worker, victim: _Worker) -> None:
    """Rank 2 dials the acceptor's listening port (its transcript names that address)."""
    real = victim.t._listener.getsockname()[1]
    victim.t.port = real
    other.t.connect(0, HOST, real, timeout=5)


# ---------------------------------------------------------------------- channels in-process
@pytest.mark.parametrize("pair", [tcp_pair, shm_pair], ids=["tcp", "shm"])
@pytest.mark.parametrize("attack", ["flip", "replay"])
def test_a_changed_or_replayed_frame_closes_the_connection(pair, attack, caplog):
    """Bytes written into the stream (the socket, or the shared ring) by someone without the
    session key: a frame sealed for one place and changed, or an earlier frame again."""
    got, lost = [], []
    done = threading.Event()
    sender, reader = pair(lambda peer, payload, bufs: got.append(bytes(payload)),
                          lambda peer, exc, clean: (lost.append(exc), done.set()))
    sender.send(b"first", [])
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    parts = wire.frame_parts(b"second", [])
    if attack == "flip":
        raw = bytearray(b"".join(bytes(p) for p in wire.sealed(sender.session, parts)))
        raw[-wire.TAG - 2] ^= 0x40  # a payload byte
    else:  # "first" again, sealed as it was (sequence number 1 of the hello's count)
        sender.session.sent -= 1
        raw = b"".join(bytes(p) for p in wire.sealed(sender.session, wire.frame_parts(
            b"first", [])))
        sender.session.sent += 1
    with caplog.at_level(logging.WARNING, logger="shardwise.rpc"):
        _write_raw(sender, bytes(raw))
        assert done.wait(10)
    assert got == [b"first"]
    assert isinstance(lost[0], wire.FrameError) and "fails its MAC" in str(lost[0])
    assert any("closing the connection to rank" in r.getMessage() for r in caplog.records)
    sender.close()
    for conn in (sender, reader):
        conn.join(10)


def _write_raw(sender, raw: bytes) -> None:
    if isinstance(sender, shm_channel.ShmConnection):
        with sender.send_lock:
            sender._written = sender.tx.copy_in(sender._written, memoryview(raw))
            sender.tx.publish(sender._written)
        sender.sock.send(b"D")
    else:
        sender.sock.sendall(raw)


def test_a_changed_byte_of_a_large_buffer_in_the_shared_pool_closes_the_connection():
    """A large buffer travels through the pool, outside the ring: its bytes are covered by
    the frame's tag through their digest."""
    got, lost = [], []
    done = threading.Event()
    sender, reader = shm_pair(lambda peer, payload, bufs: got.append(bufs),
                              lambda peer, exc, clean: (lost.append(exc), done.set()))
    big = np.arange(1 << 20, dtype=np.uint8)
    entry = sender._frame(b"big", [memoryview(big)])
    assert sender.sent_lent == 1
    sender.tx_pool.data[123] ^= 0xFF  # changed in the pool after the sender copied it
    sender._queue.append(entry)
    with sender.send_lock:
        sender._send_queued()
    assert done.wait(10)
    assert got == []
    assert isinstance(lost[0], wire.FrameError) and "fails its MAC" in str(lost[0])
    sender.close()
    for conn in (sender, reader):
        conn.join(10)


def test_a_hello_changed_to_tcp_is_refused():
    """The relay of issue 25 rewrote both channel hellos to TCP: a hello is sealed now."""
    import socket

    from tests.rpc.pairs import sessions

    a, b = socket.socketpair()
    acc, con = sessions()
    out: dict = {}

    def acceptor() -> None:
        try:
            out["acc"] = shm_channel.negotiate(a, "auto", True, 5.0, acc, 1)
        except (wire.FrameError, shm_channel.ChannelError) as exc:
            out["acc"] = exc
            a.close()

    t = threading.Thread(target=acceptor)
    t.start()
    hello = bytearray(con.seal(shm_channel._HELLO.pack(
        shm_channel._HELLO_MAGIC, shm_channel.MODES.index("shm"), shm_channel.boot_id(), 0,
        bytes(16), shm_channel.RING_BYTES, shm_channel.SEGMENT_MIN, shm_channel.POOL_BYTES)))
    hello[4] = shm_channel.MODES.index("tcp")  # the relay's rewrite
    b.sendall(bytes(hello))
    t.join(10)
    assert isinstance(out["acc"], wire.FrameError) and "fails its MAC" in str(out["acc"])
    b.close()
