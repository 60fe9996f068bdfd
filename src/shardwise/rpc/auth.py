"""Mutual authentication of a new connection with the group's token (HMAC challenge-response).

The token is the group's key, derived from a secret that never goes through the rendezvous
store ([Note: group secret] in secret.py). On connect:

    acceptor  -> connector : "SWA1" | acceptor nonce (16 bytes)
    connector -> acceptor  : "SWA1" | connector rank (u32) | connector nonce | HMAC(token, ...)
    acceptor  -> connector : HMAC(token, "acceptor" | both nonces | rank)

Each side proves it knows the token without sending it, over fresh nonces, so a recorded
handshake cannot be replayed; the rank is inside the MAC, so a connection proves both the secret
and its rank. Anything else (wrong magic, a rank that is not above the acceptor's, bad MAC, a
handshake not finished by its deadline) is an :class:`AuthError` and the socket is closed by
the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

from shardwise.rpc.wire import PeerClosed

MAGIC = b"SWA1"
NONCE = 16
_DIGEST = hashlib.sha256().digest_size
_HELLO = struct.Struct(f"!4s{NONCE}s")
HELLO_SIZE = _HELLO.size
_REPLY = struct.Struct(f"!4sI{NONCE}s{_DIGEST}s")


class AuthError(ConnectionError):
    """A connection failed the group's handshake."""


def new_token() -> bytes:
    return secrets.token_bytes(32)


def _mac(token: bytes, role: bytes, a: bytes, b: bytes, rank: int) -> bytes:
    return hmac.new(token, role + a + b + struct.pack("!I", rank), hashlib.sha256).digest()


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
                     deadline: float | None = None) -> int:
    """Run the acceptor's side; returns the authenticated peer's rank. The whole exchange
    must end before ``deadline`` (monotonic seconds)."""
    nonce = secrets.token_bytes(NONCE)
    sock.sendall(_HELLO.pack(MAGIC, nonce))
    try:
        magic, rank, peer_nonce, mac = _REPLY.unpack(recv_by(sock, _REPLY.size, deadline))
    except PeerClosed as exc:
        raise AuthError(f"connection closed during the handshake: {exc}") from exc
    if magic != MAGIC:
        raise AuthError(f"not a shardwise RPC peer (handshake magic {bytes(magic)!r})")
    if not me < rank < world_size:  # (higher ranks connect to lower ones: transport.py)
        raise AuthError(f"handshake names rank {rank}, not a rank above {me} in a world of "
                        f"{world_size}")
    if not hmac.compare_digest(mac, _mac(token, b"connector", nonce, peer_nonce, rank)):
        raise AuthError(f"peer claiming rank {rank} failed authentication (wrong group token)")
    sock.sendall(_mac(token, b"acceptor", nonce, peer_nonce, rank))
    return rank


def connect_handshake(sock: socket.socket, token: bytes, me: int,
                      deadline: float | None = None) -> None:
    """Run the connector's side; raises AuthError if the acceptor is not of our group."""
    try:
        magic, nonce = _HELLO.unpack(recv_by(sock, _HELLO.size, deadline))
        peer_nonce = secrets.token_bytes(NONCE)
        mac = _mac(token, b"connector", nonce, peer_nonce, me)
        sock.sendall(_REPLY.pack(MAGIC, me, peer_nonce, mac))
        answer = recv_by(sock, _DIGEST, deadline)
    except PeerClosed as exc:
        raise AuthError(f"peer closed the connection during the handshake: {exc}") from exc
    if magic != MAGIC:
        raise AuthError(f"not a shardwise RPC peer (handshake magic {bytes(magic)!r})")
    if not hmac.compare_digest(bytes(answer), _mac(token, b"acceptor", nonce, peer_nonce, me)):
        raise AuthError("the peer failed authentication (wrong group token)")
