"""What the socket connection (transport.py) and the shared-memory one (shm_channel.py) share.

[Note: one sender at a time] A frame is queued by the thread that sends it; whichever thread
then holds ``send_lock`` writes out everything queued, lets go, and looks again, so a frame
queued while another thread held the lock is sent either by that thread or by its own, in
queue order, and no thread waits for a lock to send. Each connection has one reader thread,
which hands every frame to ``on_frame``; the first failure (from either side) closes the
connection and reports the peer lost once, with whether the close was clean.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Callable
from typing import Any

FrameHandler = Callable[[int, bytearray, list], None]
LostHandler = Callable[[int, BaseException, bool], None]  # rank, error, clean close


class QueuedConnection:
    """A connection to ``peer``: the send queue, the reader thread and the close bookkeeping.

    Subclasses give ``_frame(payload, buffers)`` (the queued form of one frame),
    ``_send_queued()`` (write out the queue, under ``send_lock``), ``_read_loop()`` and
    ``close()``, set ``closed_error``, and call ``_start_reader()`` last in ``__init__``.
    """

    closed_error: type[Exception] = ConnectionError
    reader_name = "shardwise-rpc-reader"

    def __init__(self, sock: socket.socket, peer: int, on_frame: FrameHandler,
                 on_lost: LostHandler, max_message: int):
        self.sock, self.peer = sock, peer
        self.max_message = max_message  # per frame received, as the socket reader applies it
        self.send_lock = threading.Lock()  # held by the one thread writing out the queue
        self._queue: collections.deque = collections.deque()
        self._on_frame, self._on_lost = on_frame, on_lost
        self._state_lock = threading.Lock()
        self.closed = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"{self.reader_name}-{peer}")

    def _start_reader(self) -> None:
        self._reader.start()

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

    def _lost(self, exc: BaseException, clean: bool) -> None:
        """Close, and report the peer lost if this is the first failure."""
        with self._state_lock:
            was_closed, self.closed = self.closed, True
        self.close()
        if not was_closed:
            self._on_lost(self.peer, exc, clean)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reader thread to end (after ``close``), unless this is that thread."""
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)

    # ------------------------------------------------------------ per channel
    def _frame(self, payload: bytes, buffers: list[memoryview]) -> Any:
        raise NotImplementedError

    def _send_queued(self) -> None:
        raise NotImplementedError

    def _read_loop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
