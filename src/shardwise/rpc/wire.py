"""Frames on a stream socket: a fixed header, the buffer lengths, the payload, the buffers.

    magic "SWR1" | u32 number of buffers | u64 payload bytes | u64 length of each buffer
    payload (pickle) | buffer 0 | buffer 1 | ...

Sending gathers all parts into ``sendmsg`` calls (no concatenation, so tensor memory goes from
the tensor to the kernel); receiving reads each buffer with ``recv_into`` straight into a fresh
uninitialised tensor. Headers are checked before anything is allocated: a frame with the wrong
magic or absurd sizes is a :class:`FrameError` and the connection is dropped.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import torch

MAGIC = b"SWR1"
_FIXED = struct.Struct("!4sIQ")
MAX_BUFFERS = 1 << 16
MAX_PAYLOAD = 1 << 32  # 4 GiB of pickle is not a message, it is an attack or a bug
MAX_BUFFER = 1 << 40
_IOV_MAX = 512
SOCKET_BUFFER = 4 << 20


class FrameError(ConnectionError):
    """The peer sent bytes that are not a valid frame."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (``truncated`` when it did so inside a frame)."""

    def __init__(self, message: str, truncated: bool):
        super().__init__(message)
        self.truncated = truncated


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def send_frame(sock: socket.socket, payload: bytes, buffers: list[memoryview]) -> None:
    """Send one frame; the caller holds the connection's send lock."""
    lengths = [b.nbytes for b in buffers]
    header = _FIXED.pack(MAGIC, len(buffers), len(payload)) + struct.pack(
        f"!{len(lengths)}Q", *lengths)
    send_all(sock, [header, payload, *buffers])


def send_all(sock: socket.socket, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(memoryview(p).cast("B"))]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent:
            head = views[0]
            if sent >= len(head):
                sent -= len(head)
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def recv_frame(sock: socket.socket) -> tuple[bytearray, list[np.ndarray]]:
    """Read one frame: the payload and each buffer as a uint8 array backed by a tensor."""
    fixed = recv_exact(sock, _FIXED.size, start=True)
    magic, nbufs, plen = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r})")
    if nbufs > MAX_BUFFERS or plen > MAX_PAYLOAD:
        raise FrameError(f"frame header out of range: {nbufs} buffers, {plen} payload bytes")
    lengths = struct.unpack(f"!{nbufs}Q", recv_exact(sock, 8 * nbufs)) if nbufs else ()
    if any(n > MAX_BUFFER for n in lengths):
        raise FrameError(f"frame buffer length out of range: {max(lengths)} bytes")
    payload = recv_exact(sock, plen)
    buffers = []
    for n in lengths:
        arr = torch.empty(n, dtype=torch.uint8).numpy()
        recv_into_all(sock, memoryview(arr))
        buffers.append(arr)
    return payload, buffers


def recv_exact(sock: socket.socket, n: int, start: bool = False) -> bytearray:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf), start)
    return buf


def recv_into_all(sock: socket.socket, view: memoryview, start: bool = False) -> None:
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            if start and got == 0:
                raise PeerClosed("peer closed the connection", truncated=False)
            raise PeerClosed(f"peer closed the connection inside a frame ({got} of {total} "
                             "bytes of a part received)", truncated=True)
        got += n
