"""Only the group's members get in; garbage and truncated frames are dropped, serving goes on."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.wire import MAGIC, send_frame
from shardwise.rpc.wire.auth import AuthError, accept_handshake, connect_handshake, new_token
from shardwise.rpc.wire.transport import Connection
from tests.rpc import helpers
from tests.rpc.pairs import sessions


def _garbage(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        try:
            s.recv(64)  # the acceptor's challenge
            s.sendall(data)
            s.recv(64)  # closed by the agent: b"" or a reset
        except OSError:
            pass


def test_garbage_to_agent_port_is_dropped_and_agent_keeps_serving(rpc_world):
    port = rpc.rpc_sync("worker1", helpers.my_port)
    _garbage(port, b"\x00\xffGET / HTTP/1.1\r\n\r\n" * 8)
    _garbage(port, b"SWA1" + b"\x00" * 60)  # right magic, wrong MAC
    _garbage(port, b"SW")  # truncated handshake
    assert torch.equal(rpc.rpc_sync("worker1", helpers.add, args=(torch.ones(2),)),
                       torch.full((2,), 2.0))
    assert rpc.rpc_sync("worker2", helpers.call_other, args=("worker1", helpers.my_name)) \
        == "worker1"


ADDR = b"127.0.0.1:1"  # (the address both ends of a socket pair take for the acceptor's)


def _pair():
    a, b = socket.socketpair()
    return a, b


def test_handshake_needs_the_group_token():
    token = new_token()
    for peer_token, ok in ((token, True), (new_token(), False)):
        a, b = _pair()
        a.settimeout(5)
        b.settimeout(5)
        result = {}

        def acceptor(sock=a, out=result):
            try:
                out["rank"] = accept_handshake(sock, token, world_size=4, me=0,
                                               address=ADDR)[0]
            except AuthError as exc:
                out["error"] = exc
                sock.close()  # as the transport does: the connector sees the close

        t = threading.Thread(target=acceptor)
        t.start()
        if ok:
            connect_handshake(b, peer_token, me=2, peer=0, address=ADDR)
        else:
            with pytest.raises(AuthError):
                connect_handshake(b, peer_token, me=2, peer=0, address=ADDR)
        b.close()
        t.join(5)
        a.close()
        assert (result.get("rank") == 2) if ok else ("wrong group token" in str(result["error"]))


def test_bad_and_truncated_frames_drop_only_that_connection():
    """A connection's reader: a frame with bad magic or cut short ends that connection only."""
    frames, lost = [], []
    conns = []
    for bad in (b"XXXX" + b"\x00" * 12, MAGIC + struct.pack("!IQ", 0, 100) + b"short"):
        a, b = _pair()
        conns.append(Connection(a, 1, sessions()[0], lambda p, pl, bu: frames.append(pl),
                                lambda p, e, clean: lost.append((type(e).__name__, clean))))
        b.sendall(bad)
        b.close()
    good_a, good_b = _pair()
    got = threading.Event()
    acc, con = sessions()
    Connection(good_a, 2, con, lambda p, pl, bu: got.set(), lambda *a: None)
    send_frame(good_b, b"hello", [memoryview(b"buf")], acc)
    assert got.wait(5)
    for c in conns:
        c._reader.join(5)
    assert sorted(lost) == [("FrameError", False), ("PeerClosed", False)]
    assert frames == []


def test_handshake_refuses_a_rank_that_does_not_connect_to_this_one():
    """Higher ranks connect to lower ones: a connection to rank 2 claiming rank 1 (or 2, or one
    outside the world) is refused even with the right key."""
    token = new_token()
    for claimed in (1, 2, 4):
        a, b = _pair()
        a.settimeout(5)
        b.settimeout(5)
        result = {}

        def acceptor(sock=a, out=result):
            try:
                out["rank"] = accept_handshake(sock, token, world_size=4, me=2,
                                               address=ADDR)[0]
            except AuthError as exc:
                out["error"] = exc
                sock.close()

        t = threading.Thread(target=acceptor)
        t.start()
        with pytest.raises((AuthError, ConnectionError)):
            connect_handshake(b, token, me=claimed, peer=2, address=ADDR)
        t.join(5)
        b.close()
        assert "not a rank above 2" in str(result["error"])
