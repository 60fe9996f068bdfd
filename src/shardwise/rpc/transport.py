"""Connections between the workers of one RPC group: one authenticated TCP socket per pair.

[Note: transport] Plain stdlib sockets and threads, no event loop: every pair of workers shares
one bidirectional connection (the higher rank connects to the lower), each connection has one
reader thread that reads whole frames (in batches, [Note: batched reads] in wire.py) and hands
them to the agent, and senders write with ``sendmsg`` (wire.py). A reader thread never sends, so
two workers sending large tensors to each other cannot both block with nobody reading.

Sending combines frames: a sender appends its frame to the connection's queue and, if no other
thread is sending on that connection, sends everything queued; if another thread is sending,
that thread sends the new frame too before it lets go (see ``Connection.send``). So frames leave
in the order they were queued, frames queued during a write go out together in one ``sendmsg``,
and no sender sleeps on a lock behind another one. A frame may therefore still be queued when
``send`` returns (the queue keeps its tensors alive), as with TensorPipe's asynchronous writes.
A failed write loses the connection: every call waiting on the peer fails at once (the agent's
``_on_lost``). Compared with an asyncio loop this saves two thread hops per message (the loop
thread and back) and lets the kernel copy tensor memory straight from and into tensors, which is
where RPC latency and throughput are decided in Python.

Connections that fail the handshake (auth.py) or send frames that do not parse are logged and
closed; the acceptor keeps accepting and the other connections are unaffected.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from shardwise.rpc import shm_channel
from shardwise.rpc.auth import AuthError, accept_handshake, connect_handshake
from shardwise.rpc.wire import FrameError, FrameReader, PeerClosed, frame_parts, send_all, tune

log = logging.getLogger("shardwise.rpc")

FrameHandler = Callable[[int, bytearray, list], None]
LostHandler = Callable[[int, BaseException, bool], None]  # rank, error, clean close


class PeerUnavailable(ConnectionError):
    """No live connection to the peer (never connected, closed, or died)."""


class Connection:
    def __init__(self, sock: socket.socket, peer: int, on_frame: FrameHandler,
                 on_lost: LostHandler):
        self.sock, self.peer = sock, peer
        self.send_lock = threading.Lock()  # held by the one thread writing to the socket
        self._queue: collections.deque[list] = collections.deque()  # frames' parts, in order
        self._on_frame, self._on_lost = on_frame, on_lost
        self._state_lock = threading.Lock()
        self.closed = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"shardwise-rpc-reader-{peer}")
        self._reader.start()

    def send(self, payload: bytes, buffers: list[memoryview]) -> None:
        """Queue a frame and send what is queued unless another thread is sending already."""
        if self.closed:
            raise PeerUnavailable(f"connection to rank {self.peer} is closed")
        self._queue.append(frame_parts(payload, buffers))
        # Whoever holds the lock sends until the queue is empty, lets go, and looks again:
        # a frame queued while the lock was held is either seen then or sent by its own thread.
        while self._queue and self.send_lock.acquire(blocking=False):
            try:
                self._send_queued()
            finally:
                self.send_lock.release()
        if self.closed:
            raise PeerUnavailable(f"connection to rank {self.peer} closed while sending")

    def _send_queued(self) -> None:
        queue = self._queue
        while queue:
            parts = queue.popleft()
            while queue and len(parts) < _BATCH_PARTS:
                parts += queue.popleft()
            try:
                send_all(self.sock, parts)
            except OSError as exc:
                queue.clear()
                self._lost(exc, clean=False)
                return

    def _read_loop(self) -> None:
        reader = FrameReader(self.sock)
        while True:
            try:
                for payload, buffers in reader.next_batch():
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
        with self._state_lock:
            was_closed, self.closed = self.closed, True
        self.close()
        if not was_closed:
            self._on_lost(self.peer, exc, clean)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


_BATCH_PARTS = 256  # frames' parts gathered into one send_all


class Transport:
    """The listening socket and the connections of one worker."""

    def __init__(self, rank: int, world_size: int, token: bytes, host: str,
                 on_frame: FrameHandler, on_lost: LostHandler, handshake_timeout: float = 10.0):
        self.rank, self.world_size, self._token = rank, world_size, token
        self._on_frame, self._on_lost = on_frame, on_lost
        self._handshake_timeout = handshake_timeout
        self.channel = shm_channel.channel_mode()  # tcp, shm, or auto ([Note: shm channel])
        self.conns: dict[int, Connection | shm_channel.ShmConnection] = {}
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
        try:
            self._register(sock, peer, acceptor=True)
        except OSError as exc:
            log.warning("shardwise.rpc rank %d: no channel to rank %d: %s", self.rank, peer, exc)
            sock.close()

    def connect(self, peer: int, host: str, port: int, timeout: float) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            connect_handshake(sock, self._token, self.rank)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        try:
            self._register(sock, peer, acceptor=False)
        except BaseException:
            sock.close()
            raise

    def _register(self, sock: socket.socket, peer: int, acceptor: bool) -> None:
        tune(sock)
        # the authenticated socket becomes a channel: shared memory with a peer on this host
        link = shm_channel.negotiate(sock, self.channel, acceptor, self._handshake_timeout)
        with self._cv:
            if peer in self.conns or self._closing:
                log.warning("shardwise.rpc rank %d: dropping a second connection from rank %d",
                            self.rank, peer)
                if link is not None:
                    link.close()
                sock.close()
                return
            self.conns[peer] = Connection(sock, peer, self._on_frame, self._on_lost) \
                if link is None else shm_channel.ShmConnection(sock, peer, link, self._on_frame,
                                                                self._on_lost)
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
