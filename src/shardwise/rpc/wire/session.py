"""Per-connection session keys and the MAC every frame carries.

[Note: session MAC] The handshake (auth.py) ends with both ends holding the same transcript:
both nonces, both ranks, and the address the connector dialed (the one the acceptor must be
listening on). Two keys are derived from the group's key and that transcript, one per
direction (:func:`derive`), so a frame cannot be reflected back to its sender, and a relay
that forwarded the handshake holds neither key. Every message after the handshake (the
channel hellos of shm_channel.py, then every frame on either channel) ends with a 16-byte tag:

    tag = BLAKE3-keyed(direction key, u64 sequence number | the message's bytes)[:16]

The sequence number counts the direction's messages from 0 and is not sent: both ends count,
so a replayed, dropped or reordered message fails like a changed one. The receiver checks the
tag before anything in the message is decoded (only the header's sizes are read first, to know
where the message ends); a message that fails is a :class:`FrameError`, and the connection is
closed with a warning naming the peer (connection.py).

A frame's large buffers are covered too. On TCP the tag runs over every byte sent, the
receiver hashing each buffer in pieces as they arrive. On shared memory a buffer that goes
through the pool or a segment of its own is hashed by the sender once it has copied it there
(:meth:`Session.buffer_hasher`), and the frame's tag covers that digest; the reader hashes the
region it maps before the frame is handed on.

Why keyed BLAKE3 (the ``blake3`` package): over large buffers it is faster than HMAC-SHA256
and keyed BLAKE2b, and as fast for small messages (the measurements are in
docs/benchmarks-history.md); it alone hashes one input on several cores with the same digest
(``max_threads``), which a large shared-memory transfer needs to keep its rate, and it releases
the GIL while it hashes. Poly1305 needs a fresh key per message, which would add a key
derivation per frame. The package is imported when the first session starts, so that
``import shardwise`` (and ``shardwise bench`` on a bare GPU host) needs no more than torch.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from shardwise.rpc.wire.frames import FrameError

TAG = 16
KEY = 32
_SEQ = struct.Struct("<Q")
_BLAKE3: type | None = None  # blake3.blake3, once a session has started


def _keyed(key: bytes, data: bytes = b""):
    """A keyed BLAKE3 hasher; a large input is hashed on several cores (same digest)."""
    global _BLAKE3
    if _BLAKE3 is None:
        from blake3 import blake3

        _BLAKE3 = blake3
    return _BLAKE3(data, key=key, max_threads=_BLAKE3.AUTO)
_LABEL = b"shardwise-rpc-session-v1"


def derive(token: bytes, transcript: bytes, acceptor: bool) -> Session:
    """This end's session: (send key, receive key) from the group key and the transcript."""
    digest = hashlib.sha256(transcript).digest()
    c2a = hmac.digest(token, _LABEL + b"|connector->acceptor|" + digest, "sha256")
    a2c = hmac.digest(token, _LABEL + b"|acceptor->connector|" + digest, "sha256")
    return Session(a2c, c2a) if acceptor else Session(c2a, a2c)


class Session:
    """The two directions' keys and sequence numbers of one connection.

    ``tag_out`` is called by the one thread writing the connection (its send lock), in the
    order messages go out; ``check_in`` by the one thread holding the reading role, in the
    order they arrive. Each advances its own counter."""

    def __init__(self, send_key: bytes, recv_key: bytes):
        if len(send_key) != KEY or len(recv_key) != KEY:
            raise ValueError("session keys are 32 bytes")
        self._send_key, self._recv_key = send_key, recv_key
        self.sent = 0  # messages sent (the next one's sequence number)
        self.received = 0

    # ------------------------------------------------------------------ sending
    def tag_out(self, parts) -> bytes:
        """The tag of the next message sent, whose bytes are ``parts`` in order."""
        h = _keyed(self._send_key, _SEQ.pack(self.sent))
        for part in parts:
            h.update(part)
        self.sent += 1
        return h.digest(TAG)

    def buffer_hasher(self, outgoing: bool):
        """A fresh keyed hasher for one large buffer's bytes (fed piece by piece); its
        ``digest(TAG)`` goes into the frame's tagged bytes."""
        return _keyed(self._send_key if outgoing else self._recv_key)

    # ------------------------------------------------------------------ receiving
    def check_in(self, parts, tag, peer: int) -> None:
        """Check the next received message's tag; FrameError (the connection ends) if wrong."""
        h = _keyed(self._recv_key, _SEQ.pack(self.received))
        for part in parts:
            h.update(part)
        if not hmac.compare_digest(h.digest(TAG), bytes(tag)):
            raise FrameError(f"message {self.received} from rank {peer} fails its MAC "
                             "(changed, replayed, reordered or injected); nothing in it was "
                             "decoded")
        self.received += 1

    def receiver(self):
        """A hasher already fed the next received message's sequence number (for a message
        whose bytes arrive in pieces); finish with :meth:`check_hasher`."""
        return _keyed(self._recv_key, _SEQ.pack(self.received))

    def check_hasher(self, h, tag, peer: int) -> None:
        if not hmac.compare_digest(h.digest(TAG), bytes(tag)):
            raise FrameError(f"message {self.received} from rank {peer} fails its MAC "
                             "(changed, replayed, reordered or injected); nothing in it was "
                             "decoded")
        self.received += 1

    def seal(self, message: bytes) -> bytes:
        """``message`` with its tag (a control message such as a channel hello)."""
        return message + self.tag_out([message])

    def open(self, sealed: bytes, peer: int) -> bytes:
        """The message of ``sealed`` (``seal``'s output), checked."""
        message, tag = sealed[:-TAG], sealed[-TAG:]
        self.check_in([message], tag, peer)
        return bytes(message)
