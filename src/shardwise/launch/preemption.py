"""Graceful preemption: SIGTERM asks a training loop to stop at the end of its current step.

A cluster (or our launcher, on SIGTERM/SIGHUP/SIGINT, or when another rank failed) sends SIGTERM
and kills what is left after a grace period, which our launcher passes to its ranks as
``SHARDWISE_GRACE_SECONDS``. ``Preemption`` turns the signal into a flag with the time it
arrived; the loop reads it once per step. The ranks must stop after the *same* step and agree
on whether there is time to save, so the loop folds the flag and a vote into a collective it
already makes (see cli/train_loop.py); a rank never acts on its own flag alone.
"""

from __future__ import annotations

import signal
import threading
import time

from shardwise.distributed.env import seconds_var

GRACE_VAR = "SHARDWISE_GRACE_SECONDS"
DEFAULT_GRACE_SECONDS = 30.0
EXIT_PREEMPTED = 128 + signal.SIGTERM


def grace_from_env() -> float:
    """``$SHARDWISE_GRACE_SECONDS``: seconds a preempted rank has to save and exit."""
    return seconds_var(GRACE_VAR, DEFAULT_GRACE_SECONDS)


class Preempted(Exception):
    """Training stopped early on request, after ``step`` steps (``saved``: a checkpoint of it)."""

    def __init__(self, step: int, saved: bool):
        super().__init__(f"stopped on SIGTERM after step {step}"
                         + ("; checkpoint written" if saved else "; no time to write a checkpoint"))
        self.step, self.saved = step, saved


class Preemption:
    def __init__(self, grace_seconds: float | None = None):
        self.grace = grace_seconds if grace_seconds is not None else grace_from_env()
        self.requested_at: float | None = None

    def install(self) -> Preemption:
        """Catch SIGTERM from now on (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()

    def request(self) -> None:
        """Ask for a stop, as SIGTERM does."""
        self._handle(signal.SIGTERM, None)

    def requested(self) -> bool:
        return self.requested_at is not None

    def time_left(self) -> float:
        """Seconds until the grace period ends (infinite when no stop was asked for)."""
        if self.requested_at is None:
            return float("inf")
        return self.grace - (time.monotonic() - self.requested_at)
