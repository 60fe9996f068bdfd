"""Two connected ends of one channel in this process, over a socket pair (for channel tests)."""

from __future__ import annotations

import os
import socket
import threading

from shardwise.rpc.wire import shm_channel
from shardwise.rpc.wire.session import derive
from shardwise.rpc.wire.transport import Connection


def sessions() -> tuple:
    """(acceptor's, connector's) sessions of one connection, as a handshake leaves them."""
    token, transcript = os.urandom(32), os.urandom(48)
    return derive(token, transcript, acceptor=True), derive(token, transcript, acceptor=False)


def tcp_pair(on_frame, on_lost, defer=None):
    """(sender, reader): socket connections; the reader hands frames to ``on_frame``."""
    a, b = socket.socketpair()
    acc, con = sessions()
    reader = Connection(b, 0, con, on_frame, on_lost, defer=defer)
    sender = Connection(a, 1, acc, lambda *_: None, lambda *_: None)
    return sender, reader


def shm_pair(on_frame, on_lost, defer=None):
    """(sender, reader): shared-memory connections, negotiated as two workers would."""
    a, b = socket.socketpair()
    links: dict = {}
    ends = dict(zip((True, False), sessions()))

    def side(sock, acceptor) -> None:
        links[acceptor] = shm_channel.negotiate(sock, "shm", acceptor, 5.0, ends[acceptor],
                                                1 - acceptor)

    t = threading.Thread(target=side, args=(a, True))
    t.start()
    side(b, False)
    t.join()
    reader = shm_channel.ShmConnection(b, 0, links[False], ends[False], on_frame, on_lost,
                                       defer=defer)
    sender = shm_channel.ShmConnection(a, 1, links[True], ends[True], lambda *_: None,
                                       lambda *_: None)
    return sender, reader
