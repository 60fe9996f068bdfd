"""How long a test waits for processes to go: until they are gone, bounded by the machine's
speed now rather than by a fixed number of seconds.

[Note: waits scaled to the machine] A launcher test claims that some processes end (the ranks
of a launcher that was killed, the children a rank left behind). It polls until they are
gone and passes at once when they are. It fails only when they outlive a bound measured beside
them: ``wait_gone`` starts a fresh interpreter that imports torch (the yardstick) when the wait
begins, and the bound is ``MARGIN`` times the yardstick's time (at least ``FLOOR_S``), plus
what the test adds for a period it is about (a grace period). Everything the processes under
test still have to do before they end (start an interpreter and reach the lifeline, read
/proc, send a signal) costs less than the yardstick's import of torch, under any load: at load
1 on two cores the bound is about ten seconds, at load 20 it grows with the import. A process
that was never going to end (no lifeline, no sweep) outlives any such bound: the processes the
tests wait for would live an hour without the mechanism under test (ranks with an hour's
rendezvous timeout or in an endless all-reduce loop, children that sleep an hour), longer than
the wait's cap, ``CAP_S``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable

MARGIN = 3.0  # times the yardstick's import of torch
FLOOR_S = 5.0  # the least bound, however fast the yardstick
CAP_S = 600.0  # the wait gives up here even if the yardstick never finishes
POLL_S = 0.05


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: Iterable[int], plus: float = 0.0) -> list[int]:
    """Poll until every process in ``pids`` is gone; those still alive after the machine's
    bound (``plus`` seconds more) are returned, an empty list when all went."""
    return _wait(list(pids), plus)[0]


def assert_gone(pids: Iterable[int], plus: float = 0.0, what: str = "process(es)") -> None:
    """``wait_gone``, failing with the processes left and the bound they outlived."""
    left, yardstick, waited = _wait(list(pids), plus)
    took = yardstick.took()
    bound = (f"{MARGIN:g} x {took:.1f} s (a fresh interpreter's import of torch, at least "
             f"{FLOOR_S:g} s) + {plus:g} s" if took is not None else f"the cap, {CAP_S:g} s")
    assert not left, f"{what} {left} still alive {waited:.1f} s after the wait began ({bound})"


def _wait(pids: list[int], plus: float) -> tuple[list[int], Yardstick, float]:
    yardstick = Yardstick()
    try:
        while True:
            left = [pid for pid in pids if alive(pid)]
            bound = yardstick.bound(plus)
            limit = CAP_S if bound is None else min(bound, CAP_S)
            waited = yardstick.elapsed()
            if not left or waited > limit:
                return left, yardstick, waited
            time.sleep(POLL_S)
    finally:
        yardstick.stop()


class Yardstick:
    """A fresh interpreter importing torch, started now beside the processes under test: the
    cost of starting a rank on this machine at this moment, measured rather than assumed."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._took: float | None = None
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import torch"], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, OMP_NUM_THREADS="1"))

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def took(self) -> float | None:
        """Seconds the import took, once it is done (None before)."""
        if self._took is None and self._proc.poll() is not None:
            self._took = self.elapsed()
        return self._took

    def bound(self, plus: float = 0.0) -> float | None:
        """Seconds from the start that a wait may last, once the yardstick is done."""
        took = self.took()
        return None if took is None else plus + max(FLOOR_S, MARGIN * took)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
