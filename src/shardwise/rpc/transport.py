"""Connections between the workers of one RPC group: one authenticated TCP socket per pair.

[Note: transport] Plain stdlib sockets and threads, no event loop: every pair of workers shares
one bidirectional connection (the higher rank connects to the lower), each connection has one
reader thread that reads whole frames and hands them to the agent, and senders write under a
per-connection lock with ``sendmsg`` (wire.py). A reader thread never sends, so two workers
sending large tensors to each other cannot both block with nobody reading. Compared with an
asyncio loop this saves two thread hops per message (the loop thread and back) and lets the
kernel copy tensor memory straight from and into tensors, which is where RPC latency and
throughput are decided in Python.

Connections that fail the handshake (auth.py) or send frames that do not parse are logged and
closed; the acceptor keeps accepting and the other connections are unaffected.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from shardwise.rpc.auth import AuthError, accept_handshake, connect_handshake
from shardwise.rpc.wire import FrameError, PeerClosed, recv_frame, send_frame, tune

log = logging.getLogger("shardwise.rpc")

FrameHandler = Callable[[int, bytearray, list], None]
LostHandler = Callable[[int, BaseException, bool], None]  # rank, error, clean close


class PeerUnavailable(ConnectionError):
    """No live connection to the peer (never connected, closed, or died)."""


class Connection:
    def __init__(self, sock: socket.socket, peer: int, on_frame: FrameHandler,
                 on_lost: LostHandler):
        self.sock, self.peer = sock, peer
        self.send_lock = threading.Lock()
        self._on_frame, self._on_lost = on_frame, on_lost
        self.closed = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"shardwise-rpc-reader-{peer}")
        self._reader.start()

    def send(self, payload: bytes, buffers: list[memoryview]) -> None:
        with self.send_lock:
            if self.closed:
                raise PeerUnavailable(f"connection to rank {self.peer} is closed")
            send_frame(self.sock, payload, buffers)

    def _read_loop(self) -> None:
        while True:
            try:
                payload, buffers = recv_frame(self.sock)
                self._on_frame(self.peer, payload, buffers)
            except PeerClosed as exc:
                self._lost(exc, clean=not exc.truncated)
                return
            except (FrameError, OSError) as exc:
                self._lost(exc, clean=False)
                return
            except Exception as exc:  # noqa: BLE001 - a frame the agent could not decode
                log.error("shardwise.rpc: dropping connection to rank %d: undecodable frame "
                          "(%s: %s)", self.peer, type(exc).__name__, exc)
                self._lost(exc, clean=False)
                return

    def _lost(self, exc: BaseException, clean: bool) -> None:
        was_closed = self.closed
        self.close()
        if not was_closed:
            self._on_lost(self.peer, exc, clean)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class Transport:
    """The listening socket and the connections of one worker."""

    def __init__(self, rank: int, world_size: int, token: bytes, host: str,
                 on_frame: FrameHandler, on_lost: LostHandler, handshake_timeout: float = 10.0):
        self.rank, self.world_size, self._token = rank, world_size, token
        self._on_frame, self._on_lost = on_frame, on_lost
        self._handshake_timeout = handshake_timeout
        self.conns: dict[int, Connection] = {}
        self._cv = threading.Condition()
        self._closing = False
        self._listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = host, self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, daemon=True,
                         name="shardwise-rpc-accept").start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, addr), daemon=True,
                             name="shardwise-rpc-handshake").start()

    def _admit(self, sock: socket.socket, addr) -> None:
        try:
            sock.settimeout(self._handshake_timeout)
            peer = accept_handshake(sock, self._token, self.world_size, self.rank)
            sock.settimeout(None)
        except (AuthError, OSError) as exc:
            log.warning("shardwise.rpc rank %d: rejected connection from %s: %s",
                        self.rank, addr, exc)
            sock.close()
            return
        self._register(sock, peer)

    def connect(self, peer: int, host: str, port: int, timeout: float) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            connect_handshake(sock, self._token, self.rank)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self._register(sock, peer)

    def _register(self, sock: socket.socket, peer: int) -> None:
        tune(sock)
        with self._cv:
            if peer in self.conns or self._closing:
                log.warning("shardwise.rpc rank %d: dropping a second connection from rank %d",
                            self.rank, peer)
                sock.close()
                return
            self.conns[peer] = Connection(sock, peer, self._on_frame, self._on_lost)
            self._cv.notify_all()

    def wait_connected(self, peers: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not all(p in self.conns for p in peers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in peers if p not in self.conns]
                    raise TimeoutError(f"RPC rank {self.rank}: ranks {missing} did not connect "
                                       f"within {timeout:.0f} s")
                self._cv.wait(left)

    def send(self, peer: int, payload: bytes, buffers: list[memoryview]) -> None:
        conn = self.conns.get(peer)
        if conn is None or conn.closed:
            raise PeerUnavailable(f"no connection to rank {peer}")
        conn.send(payload, buffers)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            conns = list(self.conns.values())
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            conn.close()
