"""Relaying a rank's output with its rank in front of every line.

Lines end at ``\\n`` or ``\\r``; a segment that ended with ``\\r`` (a progress bar redrawing
itself) is written back with ``\\r`` so a terminal still redraws it in place. A sink that is not
a terminal (a log file, a pipe, CI) cannot redraw: there a redraw becomes an ordinary line, at
most one every ``REDRAW_EVERY_S`` seconds, instead of thousands of segments run together.

Every writer (each rank's relays, the launcher's own messages) writes through one
:class:`Screen`, which knows whether a redrawn line (a rank's progress bar) holds the terminal's
current line: anyone else's text then starts on a fresh line instead of over the bar.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import TextIO

REDRAW_EVERY_S = 10.0


class Screen:
    """The launcher's terminal: one lock for every writer, and which writer's redrawn line (a
    progress bar, left with the cursor at its start) is the current line. ``with screen:``
    holds the lock, as a ``threading.Lock`` would."""

    def __init__(self, lock: threading.Lock | None = None):
        self.lock = lock or threading.Lock()
        self._bar: tuple[object, TextIO] | None = None  # (writer, sink) of the open line

    def __enter__(self) -> Screen:
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def write(self, sink: TextIO, text: str, writer: object = None) -> None:
        """Write ``text`` for ``writer``; a line that another writer's redraw holds is ended
        first (the bar stays on screen as last drawn, the text goes below it)."""
        with self.lock:
            if self._bar is not None and self._bar[0] is not writer:
                self._bar[1].write("\n")
                self._bar[1].flush()
                self._bar = None
            sink.write(text)
            sink.flush()
            if text.endswith("\r"):
                self._bar = (writer, sink)
            elif text.endswith("\n"):
                self._bar = None


class PrefixedRelay(threading.Thread):
    """Reads a pipe until EOF and writes each line to ``sink`` behind ``prefix``.

    The last ``keep`` lines are kept for the failure report, in ``tail`` and also in ``merged``
    when given (one deque that a rank's stdout and stderr relays share, so that its last lines
    can be shown in the order they came). ``count`` is the number of complete lines read so far.
    """

    def __init__(self, fd: int, prefix: str, sink: TextIO, lock: threading.Lock | Screen,
                 keep: int = 400, merged: deque[str] | None = None):
        super().__init__(daemon=True)
        self.fd = fd
        self.prefix = prefix
        self.sink = sink
        self.screen = lock if isinstance(lock, Screen) else Screen(lock)
        self.tail: deque[str] = deque(maxlen=keep)
        self.merged = merged
        self.count = 0
        self.redraws_in_place = _is_terminal(sink)
        self._last_redraw = float("-inf")

    def run(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                break
            pending = self._emit_complete(pending + chunk)
        if pending:
            self._write(pending.decode(errors="replace"), "\n")
        os.close(self.fd)

    def _emit_complete(self, data: bytes) -> bytes:
        start = 0
        for i, byte in enumerate(data):
            if byte in (10, 13):  # \n, \r
                if byte == 10 or i > start:  # an empty redraw segment carries nothing
                    self._write(data[start:i].decode(errors="replace"), chr(byte))
                start = i + 1
        return data[start:]

    def _write(self, text: str, end: str) -> None:
        if end == "\n":
            self.tail.append(text)
            if self.merged is not None:
                self.merged.append(text)
            self.count += 1
        elif not self.redraws_in_place:
            now = time.monotonic()
            if now - self._last_redraw < REDRAW_EVERY_S:
                return
            self._last_redraw, end = now, "\n"
        self.screen.write(self.sink, f"{self.prefix}{text}{end}", self)


def _is_terminal(sink: TextIO) -> bool:
    try:
        return sink.isatty()
    except (AttributeError, ValueError):
        return False


def lines_since(relay: PrefixedRelay, count: int) -> list[str]:
    """The complete lines ``relay`` read after its ``count``-th (as far as its tail reaches)."""
    new = relay.count - count
    return list(relay.tail)[-new:] if new > 0 else []


def stack_dump(lines: list[str]) -> str:
    """The thread stacks faulthandler printed in ``lines``: the main thread's (the one that runs
    ``<module>``) when it can be told apart, else every thread's."""
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([line])
        elif blocks and line.startswith("  ") and not _is_launch_frame(blocks[-1]):
            blocks[-1].append(line)
    main = [b for b in blocks if any(" in <module>" in line for line in b)]
    return "\n".join("\n".join(b) for b in (main or blocks))


def _is_launch_frame(block: list[str]) -> bool:
    """True once ``block`` reached the frames that only start a rank (runpy, bootstrap.py)."""
    last = block[-1]
    if "<frozen runpy>" in last or "shardwise/launch/bootstrap.py" in last:
        block.pop()
        return True
    return False


def last_traceback(lines: list[str]) -> str:
    """The last Python traceback in ``lines`` (through its final line), or the last 30 lines."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return "\n".join(lines[-30:])
    return "\n".join(lines[starts[-1]:])
