"""One screen for every writer: the launcher's messages and other ranks' lines start on a fresh
line when a rank's progress bar holds the current line, never over it."""

import io
import os

from shardwise.launch.output import PrefixedRelay, Screen


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _relay(data: bytes, prefix: str, sink, screen: Screen) -> None:
    read, write = os.pipe()
    relay = PrefixedRelay(read, prefix, sink, screen)
    relay.start()
    os.write(write, data)
    os.close(write)
    relay.join(timeout=10)
    assert not relay.is_alive()


def test_a_message_after_a_redraw_starts_on_a_fresh_line():
    screen, sink = Screen(), _Terminal()
    _relay(b"\r 10%\r 20%\r", "[rank0]: ", sink, screen)
    screen.write(sink, "shardwise: received SIGINT; sending SIGTERM to every rank\n")
    assert sink.getvalue() == ("[rank0]:  10%\r[rank0]:  20%\r\n"
                               "shardwise: received SIGINT; sending SIGTERM to every rank\n")


def test_another_ranks_line_goes_below_the_bar_and_the_bar_goes_on():
    screen, err, out = Screen(), _Terminal(), _Terminal()
    _relay(b"\r 10%\r", "[rank0]: ", err, screen)
    _relay(b"hello\n", "[rank1]: ", out, screen)
    _relay(b"\r 20%\r", "[rank0]: ", err, screen)
    assert err.getvalue() == "[rank0]:  10%\r\n[rank0]:  20%\r"  # ended on the bar's sink
    assert out.getvalue() == "[rank1]: hello\n"


def test_the_bars_own_last_line_stays_in_place():
    screen, sink = Screen(), _Terminal()
    _relay(b"\r 10%\rdone 100%\n", "[rank0]: ", sink, screen)
    screen.write(sink, "shardwise: done\n")
    assert sink.getvalue() == "[rank0]:  10%\r[rank0]: done 100%\nshardwise: done\n"
