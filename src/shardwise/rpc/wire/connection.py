"""What the socket connection (transport.py) and the shared-memory one (shm_channel.py) share.

[Note: one sender at a time] A frame is queued by the thread that sends it; whichever thread
then holds ``send_lock`` writes out everything queued, lets go, and looks again, so a frame
queued while another thread held the lock is sent either by that thread or by its own, in
queue order, and no thread waits for a lock to send. The first failure (from either side)
closes the connection and reports the peer lost once, with whether the close was clean.

[Note: reading role] One thread at a time reads a connection: the one holding ``_role``. It
reads every frame that has arrived (never waiting for one that has not started) and hands each
to ``on_frame`` in order. Three kinds of thread take the role:

- Two reader threads per connection, each with its own epoll set. Only the *active* one has
  the socket in its set; the other sleeps in ``epoll_wait`` on an empty set, so it costs
  nothing and is never woken by the peer's bytes. A frame that asks for a call to be run
  (``on_frame`` returns the call as a function) is run by the reader itself when it was the
  last frame read and the other reader is free: the reader first moves the socket into the
  other reader's set (two ``epoll_ctl`` calls, no wake-up) and lets go of the role, so the
  connection is read while the call runs, and a call that blocks (a nested RPC, a wait on
  another call) holds nobody up. Otherwise the call goes to ``defer`` (the agent's pool). This
  saves the hand-off from reader to pool thread, a wake-up that on a small VM costs as much as
  the call itself and runs the call on a cold CPU.
- A thread that waits for the reply to its own ``rpc_sync`` (:meth:`wait_reply`) takes the
  role if it is free, takes the socket out of the active reader's set, and reads the
  connection itself: first polling without sleeping for ``SPIN_US`` microseconds (a reply that
  comes back within that time costs no wake-up at all), then sleeping in ``poll``. The reply
  completes its future on this thread, so the caller goes on without being woken by a reader.
  Frames for others are handed on as the readers would; calls go to ``defer``. When its reply
  is in, it gives the socket back to the reader it took it from.

A reader never sends frames, so two workers sending large tensors to each other cannot both
block with nobody reading (a call run by a reader sends its reply after letting go of the
role, while the other reader reads).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from shardwise.distributed.env import int_var
from shardwise.rpc.wire.frames import FrameError, PeerClosed

log = logging.getLogger("shardwise.rpc")

FrameHandler = Callable[[int, bytearray, list], "Callable[[], None] | None"]
LostHandler = Callable[[int, BaseException, bool], None]  # rank, error, clean close
Defer = Callable[[Callable[[], None]], None]

SPIN_US = int_var("SHARDWISE_RPC_SPIN_US", 400, minimum=0)  # wait_reply's poll without sleep
_SLEEP_MS = 50  # a sleeping reader looks at its future and the connection this often
_EPOLL_S = 1.0  # an idle reader looks whether the connection closed this often


def _run_on_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, daemon=True, name="shardwise-rpc-call").start()


class QueuedConnection:
    """A connection to ``peer``: the send queue, the reading role and its two reader threads,
    and the close bookkeeping.

    Subclasses give ``_frame(payload, buffers)`` (the queued form of one frame),
    ``_send_queued()`` (write out the queue, under ``send_lock``), ``_drain()`` (every whole
    frame that has arrived), ``_woken()`` and ``_may_sleep()`` (the channel's part of going to
    sleep and waking), and may give ``_closing()`` and ``_release()`` (the channel's part of
    ``close()`` and of releasing what the readers used); they set
    ``closed_error``, and call ``_start_reader()`` last in ``__init__``.
    """

    closed_error: type[Exception] = ConnectionError
    reader_name = "shardwise-rpc-reader"

    def __init__(self, sock: socket.socket, peer: int, on_frame: FrameHandler,
                 on_lost: LostHandler, max_message: int, defer: Defer | None = None):
        self.sock, self.peer = sock, peer
        self.max_message = max_message  # per frame received, as the socket reader applies it
        self.send_lock = threading.Lock()  # held by the one thread writing out the queue
        self._queue: collections.deque = collections.deque()
        self._on_frame, self._on_lost = on_frame, on_lost
        self._defer = defer or _run_on_thread
        self._state_lock = threading.Lock()
        self.closed = False
        self._fd = sock.fileno()
        self._role = threading.Lock()  # [Note: reading role]
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # written by close()
        self._eps = [select.epoll(), select.epoll()]
        for ep in self._eps:
            ep.register(self._wake_fd, select.EPOLLIN)
        self._active: int | None = 0  # the reader whose set holds the socket
        self._eps[0].register(self._fd, select.EPOLLIN)
        self._busy = [False, False]  # running a call
        self._alive = 2
        self._readers = [threading.Thread(target=self._serve, args=(i,), daemon=True,
                                          name=f"{self.reader_name}-{peer}-{i}")
                         for i in (0, 1)]
        self._reader = self._readers[0]

    def _start_reader(self) -> None:
        for thread in self._readers:
            thread.start()

    # ------------------------------------------------------------------ sending
    def send(self, payload: bytes, buffers: list[memoryview]) -> None:
        """Queue a frame and send what is queued unless another thread is sending already
        ([Note: one sender at a time])."""
        if self.closed:
            raise self.closed_error(f"connection to rank {self.peer} is closed")
        self._queue.append(self._frame(payload, buffers))
        while self._queue and self.send_lock.acquire(blocking=False):
            try:
                self._send_queued()
            finally:
                self.send_lock.release()
        if self.closed:
            raise self.closed_error(f"connection to rank {self.peer} closed while sending")

    # ------------------------------------------------------------------ reading
    def _serve(self, me: int) -> None:
        """A reader thread ([Note: reading role])."""
        ep = self._eps[me]
        look = me == 0  # the first reader looks before it sleeps (the channel may need it)
        try:
            while not self.closed:
                if not look and not ep.poll(_EPOLL_S):
                    continue
                look = False
                with self._role:
                    if self.closed:
                        return
                    if self._active != me:  # the socket left this set meanwhile
                        continue
                    call = self._read_ready(me)
                while call is not None:
                    try:
                        call()
                    except BaseException:  # noqa: BLE001 - the call's own errors are its own
                        log.exception("shardwise.rpc: a call run by a reader failed")
                    finally:
                        self._busy[me] = False
                    call = self._linger(me)
        finally:
            self._reader_done()

    def _read_ready(self, me: int) -> Callable[[], None] | None:
        """Under the role: read what has arrived; returns the call this reader runs itself."""
        call = self._pump(keep_last=True)
        if call is None or self.closed:
            return None
        other = 1 - me
        if self._busy[other]:
            self._defer(call)
            return None
        self._busy[me] = True  # (before the role goes: the other reader reads from now on)
        self._move_socket(me, other)
        return call

    def _linger(self, me: int) -> Callable[[], None] | None:
        """After running a call: read the connection without sleeping for ``SPIN_US``
        microseconds, if no other thread reads it; returns the next call to run here."""
        if not SPIN_US or not self._role.acquire(blocking=False):
            return None
        try:
            active = self._active
            if self.closed or active is None or active == me:
                return None
            self._move_socket(active, None)
            call = self._spin(time.perf_counter() + SPIN_US * 1e-6, lambda c: c is not None)
            last = None if self.closed else self._pump(keep_last=True)
            if last is not None:
                if call is not None:
                    self._defer(call)
                call = last
            self._move_socket(None, active)
            if call is not None and not self.closed:
                self._busy[me] = True
                return call
            return None
        finally:
            self._role.release()

    def _spin(self, until: float, stop: Callable[[Any], bool]) -> Callable[[], None] | None:
        """Read what arrives without sleeping until ``until`` or ``stop(call)`` (``call``: the
        last call read, returned; earlier ones go to ``defer``)."""
        self._spin_start()
        call = None
        while not self.closed and not stop(call) and time.perf_counter() < until:
            try:
                frames = self._drain()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                break
            if not frames:
                os.sched_yield()  # (lets go of the GIL)
            call = self._hand_on(frames, call)
        return call

    def _hand_on(self, frames: list, call: Callable[[], None] | None
                 ) -> Callable[[], None] | None:
        """Hand ``frames`` to ``on_frame`` in order; returns the last call they asked for
        (``call`` if none), each earlier one (``call`` included) going to ``defer``."""
        for payload, buffers in frames:
            if call is not None:
                self._defer(call)
            call = self._on_frame(self.peer, payload, buffers)
            del payload, buffers
        frames.clear()  # (no reference keeps a frame's buffers alive)
        return call

    def _pump(self, keep_last: bool) -> Callable[[], None] | None:
        """Read and hand on every frame that has arrived until the channel may sleep; calls go
        to ``defer``, except the last one read when ``keep_last`` (returned)."""
        call = None
        try:
            self._woken()
            while not self.closed:
                call = self._hand_on(self._drain(), call)
                if self._may_sleep():
                    break
        except Exception as exc:  # noqa: BLE001 - a broken peer or frame: the connection ends
            self._fail(exc)
            return None
        if call is not None and not keep_last:
            self._defer(call)
            return None
        return call

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, PeerClosed):
            self._lost(exc, clean=not exc.truncated)
            return
        if isinstance(exc, FrameError):
            log.warning("shardwise.rpc: closing the connection to rank %d: %s", self.peer, exc)
        elif not isinstance(exc, OSError):
            log.error("shardwise.rpc: dropping connection to rank %d: undecodable frame "
                      "(%s: %s)", self.peer, type(exc).__name__, exc)
        self._lost(exc, clean=False)

    def _move_socket(self, src: int | None, dst: int | None) -> None:
        """Take the socket out of reader ``src``'s set and put it into ``dst``'s (None: no
        reader's); a reader sleeping on ``dst``'s set wakes if bytes are waiting."""
        if src is not None:
            with contextlib.suppress(OSError, ValueError):
                self._eps[src].unregister(self._fd)
        if dst is not None:
            with contextlib.suppress(OSError, ValueError):
                self._eps[dst].register(self._fd, select.EPOLLIN)
        self._active = dst

    def wait_reply(self, fut: Any) -> None:
        """Read this connection on the calling thread until ``fut`` is done ([Note: reading
        role]); returns at once if another thread reads it now (then wait on ``fut``)."""
        if fut.done() or not self._role.acquire(blocking=False):
            return
        try:
            if self.closed:
                return
            active = self._active
            self._move_socket(active, None)
            try:
                self._read_until(fut)
            finally:
                if not self.closed:
                    self._pump(keep_last=False)  # the channel is ready for the reader's sleep
                self._move_socket(None, active)
        finally:
            self._role.release()

    def _read_until(self, fut: Any) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        call = self._spin(time.perf_counter() + SPIN_US * 1e-6, lambda _: fut.done())
        if call is not None:
            self._defer(call)
        while not fut.done() and not self.closed:
            if self._pump(keep_last=False) is None and not fut.done() and not self.closed:
                poller.poll(_SLEEP_MS)

    # ------------------------------------------------------------------ closing
    def _lost(self, exc: BaseException, clean: bool) -> None:
        """Close, and report the peer lost if this is the first failure."""
        with self._state_lock:
            was_closed, self.closed = self.closed, True
        self.close()
        if not was_closed:
            self._on_lost(self.peer, exc, clean)

    def _wake_readers(self) -> None:
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake_fd, 1)

    def _reader_done(self) -> None:
        """The last reader out releases what the readers used."""
        with self._state_lock:
            self._alive -= 1
            last = self._alive == 0
        if not last:
            return
        with self._role:  # no thread in wait_reply reads any more
            self.closed = True
            self._finish()
            for ep in self._eps:
                ep.close()
            os.close(self._wake_fd)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reader threads to end (after ``close``), except the calling one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._readers:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))

    # ------------------------------------------------------------ per channel
    def _frame(self, payload: bytes, buffers: list[memoryview]) -> Any:
        raise NotImplementedError

    def _send_queued(self) -> None:
        raise NotImplementedError

    def _drain(self) -> list:
        """Every whole frame that has arrived (waiting only for the rest of a started one)."""
        raise NotImplementedError

    def _woken(self) -> None:
        """The reader woke (or starts reading): the channel's wake-up bookkeeping."""

    def _may_sleep(self) -> bool:
        """Prepare the channel for a reader's sleep; False if input arrived meanwhile."""
        return True

    def _spin_start(self) -> None:
        """A thread starts polling the connection without sleeping."""

    def _finish(self) -> None:
        """After the last reader: release what reading used (``_release``), then the socket."""
        self._release()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _release(self) -> None:
        """After the last reader: the channel's own part of ``_finish``."""

    def close(self) -> None:
        """Close at once: mark the connection closed, drop what the channel must drop now
        (``_closing``), wake the readers and shut the socket down; the last reader out
        releases the rest (``_finish``)."""
        self.closed = True
        self._closing()
        self._wake_readers()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _closing(self) -> None:
        """``close`` began: the channel's own part of it."""
