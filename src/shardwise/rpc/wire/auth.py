"""Mutual authentication of a new connection with the group's key, binding the session to it.

The key is the group's, derived from a secret that never goes through the rendezvous store
([Note: group secret] in trust/secret.py). On connect:

    acceptor  -> connector : "SWA2" | acceptor nonce (16 bytes)
    connector -> acceptor  : "SWA2" | connector rank (u32) | acceptor rank it means to reach
                             (u32) | connector nonce | address length (u16) | address dialed
                             | HMAC(key, "connector" | transcript)
    acceptor  -> connector : HMAC(key, "acceptor" | transcript)

The transcript is both nonces, both ranks and the address (``host:port``) the connector dialed.
Each side proves it knows the key without sending it, over fresh nonces, so a recorded
handshake cannot be replayed; the acceptor proves it is the rank the connector meant to reach
and listens at the address the connector dialed (a relay listening elsewhere that forwards the
bytes fails here: the acceptor refuses an address that is not its own), and the session keys
of every later message are derived from the transcript ([Note: session MAC] in session.py), so
a relay that forwarded a handshake cannot speak on the connection. The address in the store
is only where to dial. Anything else (wrong magic, a rank that is not above the acceptor's, a
wrong address, bad MAC, a handshake not finished by its deadline) is an :class:`AuthError`
and the socket is closed by the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

from shardwise.rpc.wire.frames import PeerClosed
from shardwise.rpc.wire.session import Session, derive

MAGIC = b"SWA2"
NONCE = 16
_DIGEST = hashlib.sha256().digest_size
_HELLO = struct.Struct(f"!4s{NONCE}s")
HELLO_SIZE = _HELLO.size
_REPLY = struct.Struct(f"!4sII{NONCE}sH")  # then the address, then the MAC
MAX_ADDRESS = 512


class AuthError(ConnectionError):
    """A connection failed the group's handshake."""


def new_token() -> bytes:
    return secrets.token_bytes(32)


def _transcript(acceptor_nonce: bytes, connector_nonce: bytes, connector: int,
                acceptor: int, address: bytes) -> bytes:
    return MAGIC + acceptor_nonce + connector_nonce + struct.pack("!II", connector, acceptor) \
        + address


def _mac(token: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(token, role + b"|" + transcript, hashlib.sha256).digest()


def address_of(host: str, port: int) -> bytes:
    """The address as both ends write it into the transcript."""
    return f"{host}:{port}".encode()


def recv_by(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes, all received before ``deadline`` (monotonic seconds; None: the socket's
    own timeout): a peer that trickles one byte at a time cannot stretch a handshake."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AuthError(f"handshake not finished in time ({got} of {n} bytes)")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError as exc:
            raise AuthError(f"handshake not finished in time ({got} of {n} bytes)") from exc
        if k == 0:
            raise PeerClosed(f"closed after {got} of {n} bytes", truncated=got > 0)
        got += k
    return bytes(buf)


def accept_handshake(sock: socket.socket, token: bytes, world_size: int, me: int,
                     address: bytes, deadline: float | None = None) -> tuple[int, Session]:
    """Run the acceptor's side (``address``: where this worker listens, as published); returns
    the authenticated peer's rank and the connection's session. The whole exchange must end
    before ``deadline`` (monotonic seconds)."""
    nonce = secrets.token_bytes(NONCE)
    sock.sendall(_HELLO.pack(MAGIC, nonce))
    try:
        magic, rank, target, peer_nonce, size = _REPLY.unpack(
            recv_by(sock, _REPLY.size, deadline))
        if magic != MAGIC:
            raise AuthError(f"not a shardwise RPC peer (handshake magic {bytes(magic)!r})")
        if size > MAX_ADDRESS:
            raise AuthError(f"handshake address of {size} bytes (at most {MAX_ADDRESS})")
        dialed = recv_by(sock, size, deadline)
        mac = recv_by(sock, _DIGEST, deadline)
    except PeerClosed as exc:
        raise AuthError(f"connection closed during the handshake: {exc}") from exc
    if not me < rank < world_size:  # (higher ranks connect to lower ones: transport.py)
        raise AuthError(f"handshake names rank {rank}, not a rank above {me} in a world of "
                        f"{world_size}")
    transcript = _transcript(nonce, peer_nonce, rank, target, dialed)
    if not hmac.compare_digest(mac, _mac(token, b"connector", transcript)):
        raise AuthError(f"peer claiming rank {rank} failed authentication (wrong group token)")
    if target != me or dialed != address:
        raise AuthError(f"rank {rank} meant to reach rank {target} at {dialed!r}, but this is "
                        f"rank {me} at {address!r} (a relay between them?)")
    sock.sendall(_mac(token, b"acceptor", transcript))
    return rank, derive(token, transcript, acceptor=True)


def connect_handshake(sock: socket.socket, token: bytes, me: int, peer: int, address: bytes,
                      deadline: float | None = None) -> Session:
    """Run the connector's side towards rank ``peer``, dialed at ``address``; returns the
    session, or raises AuthError if whoever answered did not prove it is ``peer`` there."""
    try:
        magic, nonce = _HELLO.unpack(recv_by(sock, _HELLO.size, deadline))
        if magic != MAGIC:
            raise AuthError(f"not a shardwise RPC peer (handshake magic {bytes(magic)!r})")
        peer_nonce = secrets.token_bytes(NONCE)
        transcript = _transcript(nonce, peer_nonce, me, peer, address)
        mac = _mac(token, b"connector", transcript)
        sock.sendall(_REPLY.pack(MAGIC, me, peer, peer_nonce, len(address)) + address + mac)
        answer = recv_by(sock, _DIGEST, deadline)
    except PeerClosed as exc:
        raise AuthError(f"peer at {address!r} closed the connection during the handshake "
                        f"(not rank {peer} there, or it refused our proof): {exc}") from exc
    if not hmac.compare_digest(bytes(answer), _mac(token, b"acceptor", transcript)):
        raise AuthError(f"whoever answered at {address!r} failed to prove it is rank {peer} "
                        "of this group")
    return derive(token, transcript, acceptor=False)
