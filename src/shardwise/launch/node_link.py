"""The launchers' own connections to each other: which node's launcher is alive, and what it
reports, without the store.

[Note: node link] The rendezvous store cannot say whether another node's launcher is alive:
anyone who reaches its port can delete a record or write an old one back, and a missing or
frozen record looks like silence. So the launchers talk over connections of their own. Node
0's launcher (the hub) listens on node 0's address (port 0; the port goes into its signed join
record); every other launcher (a member) connects to it for each attempt. The handshake proves
the job's secret both ways with fresh nonces from each side:

    member -> hub:  MAGIC | nonce_m | node (2 bytes) | purpose (1) | attempt (4)
    hub -> member:  MAGIC | nonce_h | HMAC(K, "hub", nonce_m, nonce_h, hello)
    member -> hub:  HMAC(K, "member", nonce_m, nonce_h, hello)

where ``K = HMAC(secret, label, context)`` and ``context`` is the attempt's identity, agreed by
every node through the store (distributed/job_identity.py) and holding the attempt number, so
that a launcher of another job with the same secret, or of an earlier attempt, cannot connect
or be connected to. A recorded exchange cannot be replayed: the other side's nonce is new.
After it, every frame is ``length | JSON | HMAC(session, direction, sequence number, JSON)``
under a session key drawn from both nonces, so no frame can be injected, replayed, reordered or
reflected. A connection that fails the handshake is closed and logged; handshakes run in a
thread per connection with a deadline (``HANDSHAKE_S``), never in the accept loop, and at most
``MAX_PENDING`` at a time.

What travels: beats (every ``BEAT_S`` both ways), a node's failure report, the job's stop
notice and its acknowledgement, "finished", "lost" (the hub tells the members which nodes it
declared lost) and "bye" (the launcher closes its end on purpose). The hub relays every
member's report to the other members. A node is lost when its connection closes without a
"bye", or when nothing came over it for the timeout; a member whose connection to the hub ends
has lost node 0. A probe (purpose ``P``, under a key from the secret alone, since a launcher
started again for a lost node does not know the attempt's identity yet) asks the hub only
whether a node's launcher is connected and beating.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable

log = logging.getLogger("shardwise.launch")

MAGIC = b"SWL1"
NONCE_BYTES = 32
_TAG = hashlib.sha256().digest_size
_HELLO = len(MAGIC) + NONCE_BYTES + 2 + 1 + 4
_LABEL = b"shardwise-node-link-v1"
MEMBER, PROBE = b"M", b"P"
BEAT_S = 0.5  # both ends send a beat this often
LIVE_S = 4 * BEAT_S  # a probe calls a node's launcher alive when heard from this recently
HANDSHAKE_S = 10.0  # a connection that has not proved the secret by then is closed
MAX_PENDING = 16  # handshakes in progress at once; further connections are closed
MAX_FRAME = 1 << 20


class LinkError(RuntimeError):
    """A connection between launchers that failed (closed, unauthenticated, malformed)."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.digest()


def link_key(secret: bytes, context: bytes) -> bytes:
    """The handshake key of one attempt (``context``: its identity and number)."""
    return _mac(secret, _LABEL, context)


def probe_key(secret: bytes) -> bytes:
    return _mac(secret, _LABEL, b"probe")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise LinkError("the connection was closed")
        buf += chunk
    return bytes(buf)


class Channel:
    """One authenticated connection: JSON messages, each with a MAC under the session key over
    its direction and its sequence number."""

    def __init__(self, sock: socket.socket, session: bytes, hub_side: bool):
        self.sock, self._session = sock, session
        self._out, self._in = (b"hub", b"member") if hub_side else (b"member", b"hub")
        self._sent = self._received = 0
        self._lock = threading.Lock()
        self.closed = False
        self.done = threading.Event()  # set by whoever reads it, once the connection ended

    def send(self, message: dict) -> bool:
        """Send one message; False when the connection is closed."""
        payload = json.dumps(message).encode()
        with self._lock:
            if self.closed:
                return False
            tag = _mac(self._session, self._out, self._sent.to_bytes(8, "big"), payload)
            self._sent += 1
            try:
                self.sock.sendall(struct.pack(">I", len(payload)) + payload + tag)
            except OSError:
                return False
        return True

    def recv(self) -> dict:
        """The next message (blocks); LinkError when the connection ends or a frame is false."""
        (length,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if length > MAX_FRAME:
            raise LinkError(f"a frame of {length} bytes (the most is {MAX_FRAME})")
        payload, tag = _recv_exact(self.sock, length), _recv_exact(self.sock, _TAG)
        want = _mac(self._session, self._in, self._received.to_bytes(8, "big"), payload)
        if not hmac.compare_digest(tag, want):
            raise LinkError("a frame fails its MAC")
        self._received += 1
        try:
            message = json.loads(payload)
        except ValueError as exc:
            raise LinkError("a frame that is not JSON") from exc
        if not isinstance(message, dict) or not isinstance(message.get("t"), str):
            raise LinkError("a frame that is not a message")
        return message

    def close(self) -> None:
        """Close at once (what is unread is dropped, and the peer may get a reset)."""
        with self._lock:
            self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def end(self, wait: float) -> None:
        """Close gracefully: no more sending, then up to ``wait`` seconds for the reader to see
        the peer close its end (so that everything sent arrives, with no reset), then close."""
        with self._lock:
            self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        self.done.wait(wait)
        self.close()


def _hello(node: int, purpose: bytes, attempt: int) -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, MAGIC + nonce + node.to_bytes(2, "big") + purpose + attempt.to_bytes(4, "big")


def connect(host: str, port: int, node: int, purpose: bytes, attempt: int, key: bytes,
            timeout: float) -> Channel:
    """A member's end: connect to the hub and prove the secret both ways (``LinkError``, or
    OSError when nothing answers, within ``timeout``)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.settimeout(min(timeout, HANDSHAKE_S))
        nonce_m, hello = _hello(node, purpose, attempt)
        sock.sendall(hello)
        head = _recv_exact(sock, len(MAGIC) + NONCE_BYTES + _TAG)
        nonce_h, proof = head[len(MAGIC):len(MAGIC) + NONCE_BYTES], head[-_TAG:]
        if head[:len(MAGIC)] != MAGIC or not hmac.compare_digest(
                proof, _mac(key, b"hub", nonce_m, nonce_h, hello)):
            raise LinkError(f"the launcher at {host}:{port} did not prove this job's secret "
                            f"for attempt {attempt}")
        sock.sendall(_mac(key, b"member", nonce_m, nonce_h, hello))
        sock.settimeout(None)
        return Channel(sock, _mac(key, b"session", nonce_m, nonce_h, hello), hub_side=False)
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, nnodes: int, key_for: Callable[[bytes, int], bytes | None]
           ) -> tuple[int, bytes, int, Channel]:
    """The hub's end of a handshake on an accepted socket (its deadline already set): (node,
    purpose, attempt, channel). ``key_for(purpose, attempt)`` gives the key, or None to refuse.
    """
    hello = _recv_exact(sock, _HELLO)
    if hello[:len(MAGIC)] != MAGIC:
        raise LinkError("not a shardwise launcher's hello")
    nonce_m = hello[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    rest = hello[len(MAGIC) + NONCE_BYTES:]
    node, purpose, attempt = int.from_bytes(rest[:2], "big"), rest[2:3], int.from_bytes(
        rest[3:], "big")
    if not 0 < node < nnodes or purpose not in (MEMBER, PROBE):
        raise LinkError(f"a hello for node {node}, purpose {purpose!r}")
    key = key_for(purpose, attempt)
    if key is None:
        raise LinkError(f"a hello for attempt {attempt}, which this launcher is not running")
    nonce_h = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_h + _mac(key, b"hub", nonce_m, nonce_h, hello))
    proof = _recv_exact(sock, _TAG)
    if not hmac.compare_digest(proof, _mac(key, b"member", nonce_m, nonce_h, hello)):
        raise LinkError("it did not prove the job's secret")
    return node, purpose, attempt, Channel(sock, _mac(key, b"session", nonce_m, nonce_h, hello),
                                           hub_side=True)
