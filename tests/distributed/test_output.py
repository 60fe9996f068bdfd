"""The output relay: prefixed lines, progress-bar redraws kept on terminals, thinned in logs."""

import io
import os
import threading

from shardwise.launch.output import PrefixedRelay, last_traceback


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _relay(data: bytes, sink) -> PrefixedRelay:
    read, write = os.pipe()
    relay = PrefixedRelay(read, "[rank3]: ", sink, threading.Lock())
    relay.start()
    os.write(write, data)
    os.close(write)
    relay.join(timeout=10)
    assert not relay.is_alive()
    return relay


BAR = b"start\n\r 10%\r 20%\r 30%\rdone 100%\nunterminated"


def test_a_terminal_gets_every_redraw_in_place():
    sink = _Terminal()
    _relay(BAR, sink)
    assert sink.getvalue() == ("[rank3]: start\n[rank3]:  10%\r[rank3]:  20%\r[rank3]:  30%\r"
                               "[rank3]: done 100%\n[rank3]: unterminated\n")


def test_a_log_gets_redraws_as_lines_at_most_one_per_interval():
    sink = io.StringIO()
    relay = _relay(BAR, sink)
    # the first redraw is shown, the next ones fall within the interval, the final line stays
    assert sink.getvalue() == ("[rank3]: start\n[rank3]:  10%\n[rank3]: done 100%\n"
                               "[rank3]: unterminated\n")
    assert list(relay.tail) == ["start", "done 100%", "unterminated"]


def test_last_traceback_is_cut_from_the_last_one():
    lines = ["noise", "Traceback (most recent call last):", "  old", "E: old",
             "more", "Traceback (most recent call last):", "  f()", "ValueError: new"]
    assert last_traceback(lines) == "Traceback (most recent call last):\n  f()\nValueError: new"
