"""Relaying a rank's output with its rank in front of every line.

Lines end at ``\\n`` or ``\\r``; a segment that ended with ``\\r`` (a progress bar redrawing
itself) is written back with ``\\r`` so a terminal still redraws it in place. A sink that is not
a terminal (a log file, a pipe, CI) cannot redraw: there a redraw becomes an ordinary line, at
most one every ``REDRAW_EVERY_S`` seconds, instead of thousands of segments run together.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import TextIO

REDRAW_EVERY_S = 10.0


class PrefixedRelay(threading.Thread):
    """Reads a pipe until EOF and writes each line to ``sink`` behind ``prefix``.

    The last ``keep`` lines are kept for the failure report, in ``tail`` and also in ``merged``
    when given (one deque that a rank's stdout and stderr relays share, so that its last lines
    can be shown in the order they came). ``count`` is the number of complete lines read so far.
    """

    def __init__(self, fd: int, prefix: str, sink: TextIO, lock: threading.Lock, keep: int = 400,
                 merged: deque[str] | None = None):
        super().__init__(daemon=True)
        self.fd = fd
        self.prefix = prefix
        self.sink = sink
        self.lock = lock
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
        with self.lock:
            self.sink.write(f"{self.prefix}{text}{end}")
            self.sink.flush()


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
