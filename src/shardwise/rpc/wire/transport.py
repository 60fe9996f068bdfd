"""Connections between the workers of one RPC group: one authenticated TCP socket per pair.

[Note: transport] Plain stdlib sockets and threads, no event loop: every pair of workers shares
one bidirectional connection (the higher rank connects to the lower). Frames are read in
batches ([Note: batched reads] in frames.py) by whichever thread holds the connection's reading
role ([Note: reading role] in connection.py): one of its two reader threads, or a caller
waiting in ``rpc_sync`` for its reply; senders write with ``sendmsg`` (frames.py). A thread
never sends while it holds the role, so two workers sending large tensors to each other cannot
both block with nobody reading.

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

[Note: bounded acceptor] At most ``HANDSHAKE_SLOTS`` handshakes run at once, each on its own
short-lived thread and each with one deadline for the whole exchange; a connection that arrives
while every slot is taken is closed at once (a group member's ``connect`` retries until its
connect timeout). Rejections are logged at most once per ``LOG_EVERY`` seconds, with a count of
those not logged. ``close()`` shuts the listening socket down (which wakes the thread blocked
in ``accept``), closes every connection and joins every thread it started, so nothing of the
transport outlives it and the port refuses connections.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from shardwise.rpc.wire import shm_channel
from shardwise.rpc.wire.auth import AuthError, accept_handshake, address_of, connect_handshake
from shardwise.rpc.wire.connection import Defer, FrameHandler, LostHandler, QueuedConnection
from shardwise.rpc.wire.frames import (
    DEFAULT_MAX_MESSAGE,
    FrameReader,
    PeerClosed,
    frame_parts,
    sealed,
    send_all,
    tune,
)

log = logging.getLogger("shardwise.rpc")

class PeerUnavailable(ConnectionError):
    """No live connection to the peer (never connected, closed, or died)."""


class Connection(QueuedConnection):
    """A socket connection: frames' parts go out in batches, the reading role
    ([Note: reading role]) parses the stream."""

    closed_error = PeerUnavailable

    def __init__(self, sock: socket.socket, peer: int, session, on_frame: FrameHandler,
                 on_lost: LostHandler, max_message: int = DEFAULT_MAX_MESSAGE,
                 defer: Defer | None = None):
        super().__init__(sock, peer, on_frame, on_lost, max_message, defer)
        self.session = session  # [Note: session MAC] in session.py
        self._frames = FrameReader(sock, session, peer, max_message=max_message)
        self._start_reader()

    def _frame(self, payload: bytes, buffers: list[memoryview]) -> list:
        return frame_parts(payload, buffers)

    def _send_queued(self) -> None:
        queue, session = self._queue, self.session
        while queue:
            parts = sealed(session, queue.popleft())  # (tags in the order frames go out)
            while queue and len(parts) < _BATCH_PARTS:
                parts += sealed(session, queue.popleft())
            try:
                send_all(self.sock, parts)
            except OSError as exc:
                queue.clear()
                self._lost(exc, clean=False)
                return

    def _drain(self) -> list:
        return self._frames.ready_batch()


_BATCH_PARTS = 256  # frames' parts gathered into one send_all
HANDSHAKE_SLOTS = 16  # handshakes in progress at once ([Note: bounded acceptor])
LOG_EVERY = 10.0  # seconds between two rejection warnings


class RateLimitedLog:
    """A warning at most every ``every`` seconds; the next one says how many were dropped."""

    def __init__(self, every: float = LOG_EVERY):
        self.every, self._last, self._dropped = every, -float("inf"), 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every:
                self._dropped += 1
                return False
            dropped, self._dropped, self._last = self._dropped, 0, now
        suffix = f" ({dropped} more rejections not logged)" if dropped else ""
        log.warning(msg + suffix, *args)
        return True


class Transport:
    """The listening socket and the connections of one worker."""

    def __init__(self, rank: int, world_size: int, token: bytes, host: str,
                 on_frame: FrameHandler, on_lost: LostHandler, handshake_timeout: float = 10.0,
                 max_message: int = DEFAULT_MAX_MESSAGE,
                 handshake_slots: int = HANDSHAKE_SLOTS, defer: Defer | None = None):
        self.rank, self.world_size, self._token = rank, world_size, token
        self._on_frame, self._on_lost, self._defer = on_frame, on_lost, defer
        self._handshake_timeout = handshake_timeout
        self.max_message = max_message
        self.channel = shm_channel.channel_mode()  # tcp, shm, or auto ([Note: shm channel])
        self.conns: dict[int, Connection | shm_channel.ShmConnection] = {}
        self._cv = threading.Condition()
        self._closing = False
        self._slots = threading.BoundedSemaphore(handshake_slots)
        self._slot_count = handshake_slots
        self._handshakes: dict[threading.Thread, socket.socket] = {}
        self._rejections = RateLimitedLog()
        self._listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="shardwise-rpc-accept")
        self._acceptor.start()

    @property
    def group_key(self) -> bytes:
        """The group's key (handshakes, and the MAC of the group's store records)."""
        return self._token

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            if self._closing or not self._slots.acquire(blocking=False):
                self._rejections.warning("shardwise.rpc rank %d: refused a connection from %s: "
                                         "%d handshakes already in progress", self.rank, addr,
                                         self._slot_count)
                sock.close()
                continue
            thread = threading.Thread(target=self._admit, args=(sock, addr), daemon=True,
                                      name="shardwise-rpc-handshake")
            with self._cv:
                self._handshakes[thread] = sock
            thread.start()

    def _admit(self, sock: socket.socket, addr) -> None:
        try:
            deadline = time.monotonic() + self._handshake_timeout
            peer, session = accept_handshake(sock, self._token, self.world_size, self.rank,
                                             address_of(self.host, self.port), deadline)
            sock.settimeout(None)
            self._register(sock, peer, session, acceptor=True)
        except (AuthError, OSError) as exc:
            self._rejections.warning("shardwise.rpc rank %d: rejected connection from %s: %s",
                                     self.rank, addr, exc)
            sock.close()
        finally:
            with self._cv:
                self._handshakes.pop(threading.current_thread(), None)
            self._slots.release()

    def connect(self, peer: int, host: str, port: int, timeout: float) -> None:
        """Connect and authenticate to ``peer``, retrying a refused or dropped attempt (the
        acceptor's handshake slots may all be busy) until ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            try:
                self._connect_once(peer, host, port, deadline)
                return
            except (PeerClosed, ConnectionError, TimeoutError) as exc:
                if isinstance(exc, AuthError) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def _connect_once(self, peer: int, host: str, port: int, deadline: float) -> None:
        sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(),
                                                                  0.01))
        try:
            session = connect_handshake(sock, self._token, self.rank, peer,
                                        address_of(host, port), deadline)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        try:
            self._register(sock, peer, session, acceptor=False)
        except BaseException:
            sock.close()
            raise

    def _register(self, sock: socket.socket, peer: int, session, acceptor: bool) -> None:
        tune(sock)
        # the authenticated socket becomes a channel: shared memory with a peer on this host
        link = shm_channel.negotiate(sock, self.channel, acceptor, self._handshake_timeout,
                                     session, peer)
        with self._cv:
            if peer in self.conns or self._closing:
                # the rank that joined first keeps its connection ([Note: bounded acceptor])
                self._rejections.warning("shardwise.rpc rank %d: refused a second connection "
                                         "claiming rank %d", self.rank, peer)
                if link is not None:
                    link.close()
                sock.close()
                return
            self.conns[peer] = Connection(sock, peer, session, self._on_frame, self._on_lost,
                                          self.max_message, self._defer) \
                if link is None else shm_channel.ShmConnection(
                    sock, peer, link, session, self._on_frame, self._on_lost,
                    self.max_message, self._defer)
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

    def wait_reply(self, peer: int, fut) -> None:
        """Read ``peer``'s connection on this thread until ``fut`` is done, if no other thread
        reads it now ([Note: reading role])."""
        conn = self.conns.get(peer)
        if conn is not None and not conn.closed:
            conn.wait_reply(fut)

    def send(self, peer: int, payload: bytes, buffers: list[memoryview]) -> None:
        conn = self.conns.get(peer)
        if conn is None or conn.closed:
            raise PeerUnavailable(f"no connection to rank {peer}")
        conn.send(payload, buffers)

    def close(self, join_timeout: float = 10.0) -> None:
        """Stop listening, close every connection, join every thread ([Note: bounded
        acceptor])."""
        with self._cv:
            self._closing = True
            conns = list(self.conns.values())
            handshakes = list(self._handshakes.items())
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            conn.close()
        for _, sock in handshakes:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # ends the handshake now
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(join_timeout)
        for thread, _ in handshakes:
            if thread is not threading.current_thread():
                thread.join(join_timeout)
        for conn in conns:
            conn.join(join_timeout)
