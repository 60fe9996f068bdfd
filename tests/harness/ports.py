"""Ports on 127.0.0.1 for the tests, without racing the other processes of the machine.

A server the test process starts itself binds port 0 and reports the port it got (torch's
``TCPStore(..., 0, ...).port``, a listener's ``getsockname()``): no helper is needed. The
helpers here are for a port number that must be handed to another process before that process
binds it (a launcher's ``--rdzv-endpoint``, ``MASTER_PORT``, an ``init_method`` URL):

* ``reserved_port()`` keeps a socket bound to the port, with ``SO_REUSEADDR`` and never
  listening, for as long as the block runs. The kernel gives a bound port to no one else (not
  to another ``bind`` to port 0, not as a connection's local port), while a server that sets
  ``SO_REUSEADDR`` itself (torch's ``TCPStore``, through libuv or not, and so every rendezvous
  and RPC store of shardwise) can still bind and listen on it. Releasing the number first and
  hoping the other process binds it before anyone else does is the race this replaces.
* ``closed_port()`` is a port where nothing listens while the block runs: bound without
  ``SO_REUSEADDR`` and never listening, so a connection to it is refused and no other process
  can bind it.

``wait_listening`` is the event a test waits for when one process must be serving before the
next starts (a node's launcher hosting the rendezvous store): a connection accepted.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

LOCALHOST = "127.0.0.1"


@contextlib.contextmanager
def reserved_port(host: str = LOCALHOST) -> Iterator[int]:
    """A port on ``host`` that only a server given its number (and setting ``SO_REUSEADDR``)
    can bind while the block runs."""
    with _bound(host, reuse=True) as port:
        yield port


@contextlib.contextmanager
def closed_port(host: str = LOCALHOST) -> Iterator[int]:
    """A port on ``host`` where connections are refused while the block runs."""
    with _bound(host, reuse=False) as port:
        yield port


def wait_listening(port: int, timeout: float, host: str = LOCALHOST) -> None:
    """Return once something accepts connections on ``port``; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listened on {host}:{port} "
                                     f"within {timeout:g} s") from None
            time.sleep(0.05)


@contextlib.contextmanager
def _bound(host: str, reuse: bool) -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield sock.getsockname()[1]
