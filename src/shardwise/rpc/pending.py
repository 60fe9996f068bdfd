"""Outstanding calls of one agent: their futures, deadlines, and failing them.

Every call waits with a deadline (``rpc_timeout`` unless given; 0 means none). One reaper
thread keeps a heap of deadlines and fails expired calls with :class:`TimeoutError`; a peer
that disappears fails every call pending on it at once (``fail_peer``), so nobody waits for
a dead worker until its timeout.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PendingCall:
    fut: torch.futures.Future
    peer: int
    what: str  # for error messages: "rpc_sync to 'worker1'"
    timeout: float
    keep: Any = None  # objects that must outlive the call (tensors shared by CUDA IPC)


class PendingCalls:
    def __init__(self) -> None:
        self._calls: dict[int, PendingCall] = {}
        self._heap: list[tuple[float, int]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._empty_waiters = 0  # threads in wait_empty
        self._thread = threading.Thread(target=self._reap, daemon=True,
                                        name="shardwise-rpc-timeouts")
        self._thread.start()

    def add(self, msg_id: int, call: PendingCall) -> None:
        with self._cv:
            self._calls[msg_id] = call
            if call.timeout > 0:
                deadline = time.monotonic() + call.timeout
                heapq.heappush(self._heap, (deadline, msg_id))
                if self._heap[0][1] == msg_id:
                    self._cv.notify_all()

    def pop(self, msg_id: int) -> PendingCall | None:
        with self._cv:
            call = self._calls.pop(msg_id, None)
            if not self._calls and self._empty_waiters:  # (the reaper need not wake)
                self._cv.notify_all()
            return call

    def fail_peer(self, peer: int, make_error: Callable[[PendingCall], BaseException]) -> None:
        with self._cv:
            mine = [(m, c) for m, c in self._calls.items() if c.peer == peer]
            for m, _ in mine:
                del self._calls[m]
            self._cv.notify_all()
        for _, call in mine:
            _fail(call, make_error(call))

    def fail_all(self, make_error: Callable[[PendingCall], BaseException]) -> None:
        with self._cv:
            calls, self._calls = list(self._calls.values()), {}
            self._cv.notify_all()
        for call in calls:
            _fail(call, make_error(call))

    def count(self) -> int:
        return len(self._calls)

    def wait_empty(self, timeout: float | None) -> bool:
        """Wait until no call is outstanding, at most ``timeout`` seconds (None: no limit;
        every call has its own deadline unless its timeout is 0)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._empty_waiters += 1
            try:
                while self._calls:
                    left = 0.1 if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(min(left, 0.1))
                return True
            finally:
                self._empty_waiters -= 1

    def close(self, join_timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(join_timeout)

    def _reap(self) -> None:
        while True:
            expired = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, msg_id = heapq.heappop(self._heap)
                    call = self._calls.pop(msg_id, None)
                    if call is not None:
                        expired.append(call)
                if expired and not self._calls:
                    self._cv.notify_all()
                wait = self._heap[0][0] - now if self._heap else 0.5
                if not expired:
                    self._cv.wait(min(max(wait, 0.001), 0.5))
            for call in expired:
                _fail(call, TimeoutError(f"{call.what} timed out after {call.timeout:g} s "
                                         "(rpc_timeout, or the call's timeout argument)"))


def _fail(call: PendingCall, exc: BaseException) -> None:
    if not call.fut.done():
        call.fut.set_exception(exc)
