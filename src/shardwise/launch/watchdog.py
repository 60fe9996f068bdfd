"""The launcher's job-level watchdog: ranks that stop, and ranks left hanging.

It sees the launcher's own facts only (which ranks exited and how, and the progress records the
ranks write on their pipes to it, see [Note: progress records] in progress.py), timed by the
launcher's clock, and
names two kinds of hang, each after ``timeout`` seconds:

* no heartbeat: a live rank that has published a record stopped publishing (stopped, frozen, or
  holding the interpreter in native code), whether or not a collective is pending;
* left hanging: some ranks exited 0 and a live rank has neither finished nor made progress (its
  collective count and step count unchanged) since then. A rank that never published records
  (a command not started through bootstrap.py) is judged from the first clean exit.

A rank whose last record says it is exiting (its script is done; the interpreter's teardown,
which can take seconds on a loaded machine, follows) gets ``EXIT_PATIENCE`` times the timeout
before it is named, for not exiting.

Pure bookkeeping, no processes: the launcher feeds it and acts on its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXIT_PATIENCE = 4  # times the timeout, for a rank that said it is exiting


@dataclass(frozen=True)
class Hang:
    ranks: list[int]
    reason: str


@dataclass
class _Seen:
    record: dict[str, Any] | None = None
    beat_at: float | None = None  # when the record last changed (any field)
    progress_at: float | None = None  # when seq or beats last changed
    exit_code: int | None = None


class Watchdog:
    def __init__(self, ranks: list[int], timeout: float):
        self.timeout = timeout
        self._seen = {rank: _Seen() for rank in ranks}
        self._first_clean_exit: float | None = None
        self._clean: list[int] = []

    def observe(self, rank: int, record: dict[str, Any] | None, now: float) -> None:
        """Note rank ``rank``'s latest progress record (None: none yet)."""
        seen = self._seen[rank]
        if record is None or record == seen.record:
            return
        moved = seen.record is None or (record["seq"], record["beats"]) != (
            seen.record["seq"], seen.record["beats"])
        seen.record, seen.beat_at = record, now
        if moved:
            seen.progress_at = now

    def last(self, rank: int) -> dict[str, Any] | None:
        """The newest true record seen of ``rank``."""
        return self._seen[rank].record

    def exited(self, rank: int, code: int, now: float) -> None:
        self._seen[rank].exit_code = code
        if code == 0:
            self._clean.append(rank)
            if self._first_clean_exit is None:
                self._first_clean_exit = now

    def verdict(self, now: float) -> Hang | None:
        """The hang to act on now, if any (no-heartbeat first: it is the more specific)."""
        live = {r: s for r, s in self._seen.items() if s.exit_code is None}
        exiting = {r: s for r, s in live.items() if s.record and s.record.get("exiting")}
        slow = [r for r, s in exiting.items() if now - s.beat_at > EXIT_PATIENCE * self.timeout]
        live = {r: s for r, s in live.items() if r not in exiting}
        silent = [r for r, s in live.items()
                  if s.beat_at is not None and now - s.beat_at > self.timeout]
        if silent:
            return Hang(silent, f"stopped making progress: no heartbeat for more than "
                                f"{self.timeout:g} s")
        if slow:
            return Hang(slow, f"finished but did not exit within "
                              f"{EXIT_PATIENCE * self.timeout:g} s")
        if self._first_clean_exit is None:
            return None
        stuck = [r for r, s in live.items()
                 if now - max(s.progress_at or 0.0, self._first_clean_exit) > self.timeout]
        if stuck:
            return Hang(stuck, f"neither finished nor made progress for more than "
                               f"{self.timeout:g} s after rank(s) {_names(self._clean)} exited 0")
        return None


def _names(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
