"""The agent's pool of threads that run user functions and send replies.

[Note: worker pool] ``concurrent.futures.ThreadPoolExecutor`` wakes an idle thread for every
task it is given. When many calls arrive at once, all ``num_worker_threads`` threads end up
runnable, and in one Python process they mostly take turns at the GIL and at the socket:
several context switches per call on the callee (docs/rpc.md). This pool wakes a
thread only when no thread is running tasks; a running thread takes the next task itself, without
sleeping in between. That alone would make a task that blocks (a nested RPC, a wait on another
call) hold up every task queued behind it, so a watchdog thread looks at the queue every
``STALL`` seconds while tasks wait behind running ones, and when no task was started since its
last look it stops counting the running threads (they are blocked, or long) and wakes (or starts)
one more. Up to ``size`` tasks still run at once, as in torch, when they need to; they are just
not all woken for a burst of cheap ones.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shardwise.rpc")

STALL = 0.001  # seconds without a task started (queue not empty) before another thread wakes


class _Worker:
    """One pool thread's state (guarded by the pool's lock)."""

    __slots__ = ("cv", "woken")

    def __init__(self, lock: threading.Lock) -> None:
        self.cv = threading.Condition(lock)
        self.woken = False


class WorkerPool:
    """Up to ``size`` daemon threads that run submitted tasks ([Note: worker pool])."""

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name
        self._tasks: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # waiting for work, most recent last
        self._running: set[_Worker] = set()  # running tasks (or woken to), not stuck
        self._threads = 0
        self._started = 0  # tasks taken so far, for the watchdog
        self._watch_cv = threading.Condition(self._lock)
        self._watching = False  # tasks were queued while threads were running
        self._closed = False
        self._threads_started: list[threading.Thread] = []
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"{name}-watchdog")
        self._watcher.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread (exceptions are logged, never raised here)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RPC worker pool is shut down")
            self._tasks.append((fn, args))
            if not self._running:
                self._wake()
            elif not self._watching:
                self._watching = True
                self._watch_cv.notify()

    def _wake(self) -> None:
        """One more thread runs tasks (the caller holds the lock)."""
        if self._idle:
            worker = self._idle.pop()
            worker.woken = True
            self._running.add(worker)
            worker.cv.notify()
        elif self._threads < self._size:
            worker = _Worker(self._lock)
            self._running.add(worker)
            self._threads += 1
            thread = threading.Thread(target=self._run, args=(worker,), daemon=True,
                                      name=f"{self._name}_{self._threads - 1}")
            self._threads_started.append(thread)
            thread.start()

    def _run(self, worker: _Worker) -> None:
        while True:
            task = self._next(worker)
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a task's own errors are its business
                log.exception("shardwise.rpc: a worker task failed")
            del task, fn, args

    def _next(self, worker: _Worker) -> tuple[Callable, tuple] | None:
        with self._lock:
            while not self._tasks:
                self._running.discard(worker)
                if self._closed:
                    return None
                self._idle.append(worker)
                worker.woken = False
                while not worker.woken and not self._closed:
                    worker.cv.wait()
            self._running.add(worker)
            self._started += 1
            return self._tasks.popleft()

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._watching:
                    self._watch_cv.wait()
                    continue
                seen = self._started
                self._watch_cv.wait(STALL)
                if not self._tasks:
                    self._watching = False
                elif self._started == seen:  # the running tasks block: run one more thread
                    self._running.clear()  # (each counts again once it takes its next task)
                    self._wake()

    def shutdown(self) -> None:
        """Drop queued tasks and let the threads finish what they run (nobody waits)."""
        with self._lock:
            self._closed = True
            self._tasks.clear()
            for worker in self._idle:
                worker.cv.notify()
            self._idle.clear()
            self._watch_cv.notify()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the pool's threads to end (after
        ``shutdown``); a thread still running a task past that is left to finish it."""
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for thread in [self._watcher, *self._threads_started]:
            if thread is not me:
                thread.join(max(deadline - time.monotonic(), 0.0))
