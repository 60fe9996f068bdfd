"""Two connected ends of one channel in this process, over a socket pair (for channel tests)."""

from __future__ import annotations

import socket
import threading

from shardwise.rpc import shm_channel
from shardwise.rpc.transport import Connection


def tcp_pair(on_frame, on_lost, defer=None):
    """(sender, reader): socket connections; the reader hands frames to ``on_frame``."""
    a, b = socket.socketpair()
    reader = Connection(b, 0, on_frame, on_lost, defer=defer)
    sender = Connection(a, 1, lambda *_: None, lambda *_: None)
    return sender, reader


def shm_pair(on_frame, on_lost, defer=None):
    """(sender, reader): shared-memory connections, negotiated as two workers would."""
    a, b = socket.socketpair()
    links: dict = {}

    def side(sock, acceptor) -> None:
        links[acceptor] = shm_channel.negotiate(sock, "shm", acceptor, 5.0)

    t = threading.Thread(target=side, args=(a, True))
    t.start()
    side(b, False)
    t.join()
    reader = shm_channel.ShmConnection(b, 0, links[False], on_frame, on_lost, defer=defer)
    sender = shm_channel.ShmConnection(a, 1, links[True], lambda *_: None, lambda *_: None)
    return sender, reader
