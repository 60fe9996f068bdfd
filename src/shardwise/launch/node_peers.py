"""What each launcher knows of the others, from the connections of node_link.py: node 0's
``Hub`` and every other node's ``Member`` ([Note: node link] in node_link.py).

Each attempt is a round: the members connect under the attempt's identity, and every beat,
report and notice of the round is kept in a ``_Round``. A node is lost when its connection
closes without a "bye" or stays silent for the timeout; nothing read from the store counts.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from shardwise.launch.node_link import (
    BEAT_S,
    HANDSHAKE_S,
    LIVE_S,
    MAX_PENDING,
    MEMBER,
    PROBE,
    Channel,
    LinkError,
    accept,
    connect,
    link_key,
    probe_key,
)

log = logging.getLogger("shardwise.launch")
_RETRY_S = 0.2
_END_S = 2.0  # how long a launcher waits for a peer to close its end after a goodbye


@dataclass
class _Round:
    attempt: int
    key: bytes
    since: float  # when the round began (monotonic)
    channels: dict[int, Channel] = field(default_factory=dict)
    heard: dict[int, float] = field(default_factory=dict)  # last message from each node
    gone: dict[int, str] = field(default_factory=dict)  # connection ended without a "bye": why
    left: set[int] = field(default_factory=set)  # said "bye"
    failed: dict[int, str] = field(default_factory=dict)  # each node's failure report
    finished: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)  # declared lost (by the hub)
    never: set[int] = field(default_factory=set)  # of those, never connected in this round


class _Peers:
    """State and threads that the hub and the members share."""

    def __init__(self, node_rank: int, nnodes: int, secret: bytes, timeout: float):
        self.node_rank, self.nnodes, self.secret, self.timeout = node_rank, nnodes, secret, timeout
        self.round: _Round | None = None
        self.stop: str | None = None  # the job's stop notice
        self.saw_stop: set[int] = set()
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._beat_loop, daemon=True, name="shardwise-node-beat").start()

    def _beat_loop(self) -> None:
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, timeout=BEAT_S):
                    return
            self.send("beat")

    def _channels(self) -> list[Channel]:
        with self._cond:
            return list(self.round.channels.values()) if self.round else []

    def send(self, kind: str, **fields) -> None:
        """Send a message to every connected peer (the hub: every member; a member: the hub)."""
        for channel in self._channels():
            channel.send({"t": kind, **fields})

    def _read(self, rnd: _Round, node: int, channel: Channel) -> None:
        """The reader thread of one connection: each message into the round, then why it
        ended."""
        try:
            while True:
                message = channel.recv()
                with self._cond:
                    rnd.heard[node] = time.monotonic()
                    self._on_message(rnd, node, message)
        except (LinkError, OSError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
            with self._cond:
                if rnd.channels.get(node) is channel and node not in rnd.left:
                    rnd.gone.setdefault(node, why)
            if "MAC" in why:
                log.warning("shardwise: node link: closed the connection of node %d: %s",
                            node, why)
        finally:  # the peer closed its end, or the connection failed: close this end too
            channel.done.set()
            channel.close()

    def _on_message(self, rnd: _Round, node: int, message: dict) -> None:
        raise NotImplementedError

    def _note(self, rnd: _Round, node: int, message: dict) -> None:
        """What both ends do with a report from ``node`` (under the lock)."""
        kind, text = message["t"], str(message.get("text", ""))
        if kind == "failed":
            rnd.failed.setdefault(node, text)
        elif kind == "stopped":
            self.stop = self.stop or text
        elif kind == "saw_stop":
            self.saw_stop.add(node)
        elif kind == "finished":
            rnd.finished.add(node)
        elif kind == "bye":
            rnd.left.add(node)

    def _start_reader(self, rnd: _Round, node: int, channel: Channel) -> None:
        threading.Thread(target=self._read, args=(rnd, node, channel), daemon=True,
                         name=f"shardwise-node-link-{node}").start()

    # -- what the launcher asks ----------------------------------------------------------------

    def failure(self) -> tuple[int, str] | None:
        """Another node's failure report in this round: (node, its text), else None."""
        with self._cond:
            reports = sorted(self.round.failed.items()) if self.round else []
        return next(((k, t) for k, t in reports if k != self.node_rank), None)

    def stop_text(self) -> str | None:
        with self._cond:
            return self.stop

    def ack_stop(self) -> None:
        """Tell the peers this launcher has seen the stop notice."""
        self.send("saw_stop")

    def note_stop(self, text: str) -> None:
        """This launcher was told to stop: say so to the peers."""
        with self._cond:
            self.stop = self.stop or text
        self.send("stopped", text=text)

    def close(self) -> None:
        """Say "bye" on every connection and close it (and the hub's listener)."""
        self.send("bye")
        with self._cond:
            self._closed = True
            channels = list(self.round.channels.values()) if self.round else []
            self._cond.notify_all()
        _end(channels)


class Hub(_Peers):
    """Node 0's end: listens, admits the launchers that prove the secret, relays their reports
    to each other and judges whether each is alive."""

    def __init__(self, host: str, nnodes: int, secret: bytes, timeout: float):
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._server = socket.create_server((host, 0), family=family)
        self.port = self._server.getsockname()[1]
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self.job_id = b""  # the job's identity, which a probe is told
        super().__init__(0, nnodes, secret, timeout)
        threading.Thread(target=self._accept_loop, daemon=True,
                         name="shardwise-node-link-accept").start()

    def begin(self, attempt: int, context: bytes) -> None:
        """Start the round of ``attempt``: members connect under ``context``; the previous
        round's connections are closed."""
        with self._cond:
            old = list(self.round.channels.values()) if self.round else []
            self.round = _Round(attempt, link_key(self.secret, context), time.monotonic())
            self._cond.notify_all()
        for channel in old:
            channel.send({"t": "bye"})
        _end(old)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._server.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(_RETRY_S)  # out of descriptors, for a moment
                continue
            if not self._pending.acquire(blocking=False):
                log.warning("shardwise: node link: dropped a connection from %s: %d "
                            "handshakes already in progress", address[0], MAX_PENDING)
                sock.close()
                continue
            threading.Thread(target=self._admit, args=(sock, address), daemon=True,
                             name="shardwise-node-link-admit").start()

    def _admit(self, sock: socket.socket, address) -> None:
        """One connection's handshake, within ``HANDSHAKE_S`` (never in the accept loop)."""
        try:
            sock.settimeout(HANDSHAKE_S)
            timer = threading.Timer(HANDSHAKE_S, _shut, args=(sock,))
            timer.start()
            try:
                node, purpose, attempt, channel = accept(sock, self.nnodes, self._key_for)
            finally:
                timer.cancel()
            sock.settimeout(None)
        except (LinkError, OSError, ValueError) as exc:
            log.warning("shardwise: node link: dropped a connection from %s: %s", address[0],
                        exc or type(exc).__name__)
            sock.close()
            return
        finally:
            self._pending.release()
        if purpose == PROBE:
            channel.send({"t": "probe", "live": self._live(node), "job": self.job_id.hex()})
            channel.close()
        else:
            self._register(attempt, node, channel)

    def _key_for(self, purpose: bytes, attempt: int) -> bytes | None:
        if purpose == PROBE:
            return probe_key(self.secret)
        with self._cond:  # a member may finish agreeing on the attempt before this node does
            self._cond.wait_for(lambda: self._closed or self.round is not None
                                and self.round.attempt >= attempt, timeout=HANDSHAKE_S)
            rnd = self.round
            return rnd.key if rnd is not None and rnd.attempt == attempt else None

    def _register(self, attempt: int, node: int, channel: Channel) -> None:
        with self._cond:
            rnd = self.round
            if rnd is None or rnd.attempt != attempt or self._closed:
                channel.close()
                return
            old = rnd.channels.get(node)
            rnd.channels[node] = channel
            rnd.heard[node] = time.monotonic()
            rnd.gone.pop(node, None)
            rnd.left.discard(node)
        if old is not None:
            old.close()
        self._start_reader(rnd, node, channel)

    def _live(self, node: int) -> bool:
        with self._cond:
            rnd = self.round
            return (rnd is not None and node in rnd.channels and node not in rnd.gone
                    and node not in rnd.left
                    and time.monotonic() - rnd.heard.get(node, 0.0) < LIVE_S)

    def _on_message(self, rnd: _Round, node: int, message: dict) -> None:
        self._note(rnd, node, message)
        kind = message["t"]
        if kind in ("failed", "stopped"):  # every other member hears it too
            relay = {"t": kind, "node": node, "text": str(message.get("text", ""))}
            for k, channel in rnd.channels.items():
                if k != node:
                    channel.send(relay)

    def lost(self, now: float) -> list[int]:
        """Members whose connection closed without a "bye", or that were silent for the
        timeout (never connected in this round counts from its start); the members hear of
        it."""
        with self._cond:
            rnd = self.round
            if rnd is None:
                return []
            lost = [k for k in range(1, self.nnodes)
                    if k not in rnd.left and k not in rnd.finished
                    and (k in rnd.gone or now - rnd.heard.get(k, rnd.since) > self.timeout)]
            new = [k for k in lost if k not in rnd.lost]
            rnd.lost.update(new)
            rnd.never.update(k for k in new if k not in rnd.channels)
        if new:
            self.send("lost", nodes=new)
        return lost

    def never_connected(self, nodes: list[int]) -> bool:
        """Whether every node in ``nodes`` never connected in this round."""
        with self._cond:
            return self.round is not None and all(k in self.round.never for k in nodes)

    def heard_since(self, t: float) -> bool:
        with self._cond:
            rnd = self.round
            return rnd is not None and all(rnd.heard.get(k, float("-inf")) > t
                                           for k in range(1, self.nnodes))

    def finish(self) -> bool:
        """This node's ranks succeeded; True once every node said so."""
        with self._cond:
            self.round.finished.add(0)
        return self.all_finished()

    def all_finished(self) -> bool:
        with self._cond:
            return self.round is not None and len(self.round.finished) == self.nnodes

    def others_saw_stop(self) -> bool:
        """Every member acknowledged the stop notice, or its connection is gone."""
        with self._cond:
            rnd = self.round
            return rnd is None or all(k in self.saw_stop or k in rnd.gone or k in rnd.left
                                      or k not in rnd.channels for k in range(1, self.nnodes))

    def close(self) -> None:
        super().close()
        with contextlib.suppress(OSError):
            self._server.close()


class Member(_Peers):
    """Another node's end: one connection to the hub per attempt."""

    def __init__(self, node_rank: int, nnodes: int, secret: bytes, timeout: float,
                 host: str, port: int):
        self.host, self.port = host, port
        super().__init__(node_rank, nnodes, secret, timeout)

    def begin(self, attempt: int, context: bytes) -> None:
        """Connect to the hub for ``attempt`` (retrying until the timeout); ``LinkError`` when
        it cannot be reached or does not prove the secret."""
        key = link_key(self.secret, context)
        with self._cond:
            old = list(self.round.channels.values()) if self.round else []
        for channel in old:
            channel.send({"t": "bye"})
        _end(old)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                channel = connect(self.host, self.port, self.node_rank, MEMBER, attempt, key,
                                  max(1.0, deadline - time.monotonic()))
                break
            except (LinkError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise LinkError(f"could not reach node 0's launcher at {self.host}:"
                                    f"{self.port} within {self.timeout:g} s ({exc})") from exc
                time.sleep(_RETRY_S)
        now = time.monotonic()
        rnd = _Round(attempt, key, now, channels={0: channel}, heard={0: now})
        with self._cond:
            self.round = rnd
        self._start_reader(rnd, 0, channel)

    def _on_message(self, rnd: _Round, node: int, message: dict) -> None:
        sender = message.get("node", node)  # a report the hub relays names its node
        sender = sender if isinstance(sender, int) and 0 <= sender < self.nnodes else node
        if message["t"] == "lost":
            nodes = message.get("nodes")
            if isinstance(nodes, list):
                rnd.lost.update(k for k in nodes if isinstance(k, int))
        else:
            self._note(rnd, sender, message)

    def lost(self, now: float) -> list[int]:
        """The nodes the hub declared lost, and node 0 itself when the connection to it ended
        or stayed silent for the timeout."""
        with self._cond:
            rnd = self.round
            if rnd is None:
                return []
            lost = set(rnd.lost) - {self.node_rank}
            if 0 in rnd.gone or 0 in rnd.left or now - rnd.heard.get(0, rnd.since) > self.timeout:
                lost.add(0)
            return sorted(lost)

    def never_connected(self, nodes: list[int]) -> bool:
        return False

    def heard_since(self, t: float) -> bool:
        with self._cond:
            rnd = self.round
            return rnd is not None and not rnd.lost and rnd.heard.get(0, float("-inf")) > t

    def finish(self) -> bool:
        self.send("finished")
        return True

    def all_finished(self) -> bool:
        return True


def probe(host: str, port: int, node: int, secret: bytes, timeout: float
          ) -> tuple[bool, bytes] | None:
    """Ask the hub whether node ``node``'s launcher is connected and beating, and the job's
    identity; None when the hub cannot be asked or has no identity yet."""
    try:
        channel = connect(host, port, node, PROBE, 0, probe_key(secret), timeout)
    except (LinkError, OSError):
        return None
    try:
        channel.sock.settimeout(timeout)
        answer = channel.recv()
        job = bytes.fromhex(str(answer.get("job", "")))
        return (bool(answer.get("live")), job) if answer.get("t") == "probe" and job else None
    except (LinkError, OSError, ValueError):
        return None
    finally:
        channel.close()


def _end(channels: list[Channel]) -> None:
    """End ``channels`` gracefully, together within ``_END_S``."""
    threads = [threading.Thread(target=c.end, args=(_END_S,), daemon=True) for c in channels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
