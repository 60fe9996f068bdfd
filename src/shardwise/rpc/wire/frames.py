"""Frames on a stream socket: a fixed header, the buffer lengths, the payload, the buffers.

    magic "SWR1" | u32 number of buffers | u64 payload bytes | u64 length of each buffer
    payload (pickle) | buffer 0 | buffer 1 | ... | tag (16 bytes)

The tag is the frame's MAC under the connection's session key and sequence number ([Note:
session MAC] in session.py); the reader checks it before it hands the frame on, so nothing of
a frame that fails is decoded.

Sending gathers all parts into ``sendmsg`` calls (no concatenation, so tensor memory goes from
the tensor to the kernel); receiving reads small frames many at a time through one buffer
([Note: batched reads]) and the buffers of a large frame with ``recv_into`` straight into fresh
uninitialised memory that becomes the tensors. Headers are checked before anything is
allocated: a frame with the wrong magic or absurd sizes is a :class:`FrameError` and the
connection is dropped.

[Note: bounded frames] A header only claims sizes; memory follows the bytes that arrive. The
frame's total (payload and buffers) must be at most the agent's ``max_message_size`` (a
FrameError before anything is allocated); the pickle payload is then received in pieces into a
buffer that grows as they come, and a tensor buffer is reserved with ``np.empty`` (address space
only: pages are committed as ``recv_into`` writes them, nothing is zeroed), so a header that
claims gigabytes costs what the peer actually sends.
"""

from __future__ import annotations

import socket
import struct

import numpy as np

MAGIC = b"SWR1"
TAG = 16  # the frame's MAC (session.py)
_CHUNK = 16 << 20  # a large buffer is received and hashed in pieces of this size
_FIXED = struct.Struct("!4sIQ")
MAX_BUFFERS = 1 << 16
DEFAULT_MAX_MESSAGE = 1 << 36  # 64 GiB per frame, payload and tensors together
_GROW = 1 << 20  # a large payload is received in pieces of this size
_IOV_MAX = 512
_JOIN = 16 << 10  # payloads up to this are sent in one piece with the header
_BUFFER = 256 << 10  # a reader's receive buffer
LARGE = 64 << 10  # frames above this are read straight into their tensors
SOCKET_BUFFER = 4 << 20


class FrameError(ConnectionError):
    """The peer sent bytes that are not a valid frame."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (``truncated`` when it did so inside a frame)."""

    def __init__(self, message: str, truncated: bool):
        super().__init__(message)
        self.truncated = truncated


KEEPALIVE = (30, 5, 4)  # idle seconds, seconds between probes, probes: a vanished host ~50 s


def tune(sock: socket.socket) -> None:
    """No Nagle delay, large buffers, and TCP keepalive, so that a peer whose host vanished
    without closing the connection (power, network) is noticed as lost: nothing then waits
    for it forever, not even a graceful shutdown, which has no time limit."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def frame_parts(payload: bytes, buffers: list[memoryview]) -> list:
    """The parts of one frame, for :func:`send_all` (the header joined to a small payload)."""
    header = _FIXED.pack(MAGIC, len(buffers), len(payload))
    if buffers:
        header += struct.pack(f"!{len(buffers)}Q", *[b.nbytes for b in buffers])
    if len(payload) <= _JOIN:
        return [header + payload, *buffers]
    return [header, payload, *buffers]


def sealed(session, parts: list) -> list:
    """``parts`` of one frame followed by its tag (the session's next sequence number)."""
    return [*parts, session.tag_out(parts)]


def send_frame(sock: socket.socket, payload: bytes, buffers: list[memoryview],
               session) -> None:
    """Send one frame at once on ``sock`` (the transport queues frames instead: see
    ``Connection.send``; this is for writing a frame to a raw socket, as tests do)."""
    send_all(sock, sealed(session, frame_parts(payload, buffers)))


def send_all(sock: socket.socket, parts: list) -> None:
    """Send every part, gathered into as few ``sendmsg`` calls as the kernel takes."""
    views = [p if type(p) is bytes else memoryview(p).cast("B") for p in parts]
    views = [v for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        done = 0
        while sent and sent >= len(views[done]):
            sent -= len(views[done])
            done += 1
        del views[:done]
        if sent:
            views[0] = memoryview(views[0])[sent:]


class FrameReader:
    """Reads frames from a socket through one receive buffer.

    [Note: batched reads] Small frames are read many at a time: one ``recv_into`` fills the
    buffer with whatever the peer sent, and :meth:`next_batch` returns every whole frame in it,
    so a burst of calls costs one system call, not four per frame. A frame larger than
    ``LARGE`` is read as before: its buffers go straight from the socket into fresh tensors.
    """

    def __init__(self, sock: socket.socket, session, peer: int, size: int = _BUFFER,
                 max_message: int = DEFAULT_MAX_MESSAGE):
        self.sock, self.session, self.peer = sock, session, peer
        self.max_message = max_message
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def next_batch(self) -> list[tuple[bytes, list[np.ndarray]]]:
        """Block until at least one whole frame arrived; return all whole frames buffered."""
        while True:
            batch: list = []
            size = self._take_buffered(batch)
            if batch:
                return batch
            if size is not None and size > LARGE:
                return [self._read_large()]
            self._fill(size or _FIXED.size)

    def ready_batch(self) -> list[tuple[bytes, list[np.ndarray]]]:
        """Every whole frame that has arrived, without waiting for one that has not (a large
        frame whose header is here is read to its end); [] when none has."""
        batch: list = []
        while True:
            size = self._take_buffered(batch)
            if size is not None and size > LARGE:
                batch.append(self._read_large())
                continue
            if not self._fill(size or _FIXED.size, wait=False):
                return batch

    def _take_buffered(self, batch: list) -> int | None:
        """Append every whole frame in the buffer to ``batch``; returns the size of the frame
        left at its head (None: the buffer is empty), as :meth:`_head_size`."""
        size = self._head_size()
        while size is not None and size <= self._end - self._start:
            batch.append(self._take(size))
            size = self._head_size()
        return size

    def _head_size(self) -> int | None:
        """Bytes of the frame at the head of the buffer, once its header is buffered."""
        have = self._end - self._start
        if have < _FIXED.size:
            return None if have == 0 else _FIXED.size + 1  # (any size above what is here)
        magic, nbufs, plen = _FIXED.unpack_from(self._buf, self._start)
        check_header(magic, nbufs, plen, self.max_message)
        head = _FIXED.size + 8 * nbufs
        if have < head:
            return head + plen + 1 if head <= LARGE else head + LARGE
        lengths = struct.unpack_from(f"!{nbufs}Q", self._buf, self._start + _FIXED.size)
        check_lengths(plen, lengths, self.max_message)
        return head + plen + sum(lengths) + TAG

    def _take(self, size: int) -> tuple[bytes, list[np.ndarray]]:
        """Cut the whole frame at the head of the buffer out of it once its tag holds (copies:
        the buffer is reused)."""
        at = self._start
        end = at + size - TAG
        self.session.check_in([self._view[at:end]], self._view[end:end + TAG], self.peer)
        _, nbufs, plen = _FIXED.unpack_from(self._buf, at)
        lengths = struct.unpack_from(f"!{nbufs}Q", self._buf, at + _FIXED.size)
        at += _FIXED.size + 8 * nbufs
        payload = bytes(self._view[at:at + plen])
        at += plen
        buffers = []
        for n in lengths:
            buffers.append(np.frombuffer(self._buf, np.uint8, n, at).copy())
            at += n
        self._start += size
        return payload, buffers

    def _fill(self, need: int, wait: bool = True) -> bool:
        """One ``recv_into`` (blocking unless not ``wait``); makes room for a frame of ``need``
        bytes first. False when nothing was there to read (only when not ``wait``)."""
        have = self._end - self._start
        if have == 0:
            self._start = self._end = 0
        elif len(self._buf) - self._start < min(need, LARGE) + _FIXED.size:
            self._buf[:have] = bytes(self._view[self._start:self._end])  # (may overlap)
            self._start, self._end = 0, have
        try:
            n = self.sock.recv_into(self._view[self._end:]) if wait else \
                self.sock.recv_into(self._view[self._end:], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if n == 0:
            raise PeerClosed("peer closed the connection", truncated=False) if have == 0 \
                else PeerClosed("peer closed the connection inside a frame", truncated=True)
        self._end += n
        return True

    def _read_large(self) -> tuple[bytearray, list[np.ndarray]]:
        """Read the (large) frame at the head: buffered bytes first, the rest from the socket."""
        fixed = self._read_exact(_FIXED.size)
        _, nbufs, plen = _FIXED.unpack(fixed)
        sizes = self._read_exact(8 * nbufs) if nbufs else b""
        lengths = struct.unpack(f"!{nbufs}Q", sizes) if nbufs else ()
        mac = self.session.receiver()
        mac.update(fixed)
        mac.update(sizes)
        payload = self._read_growing(plen)
        mac.update(payload)
        buffers = []
        for n in lengths:
            arr = np.empty(n, np.uint8)  # (numpy asks for huge pages: far fewer page faults)
            view = memoryview(arr)
            for at in range(0, n, _CHUNK):  # (hashed while the piece is in cache)
                self._read_into(view[at:at + _CHUNK])
                mac.update(view[at:at + _CHUNK])
            buffers.append(arr)
        self.session.check_hasher(mac, self._read_exact(TAG), self.peer)
        return payload, buffers

    def _read_exact(self, n: int) -> bytearray:
        out = bytearray(n)
        self._read_into(memoryview(out))
        return out

    def _read_growing(self, n: int) -> bytearray:
        """``n`` bytes into a buffer that grows as they arrive ([Note: bounded frames])."""
        if n <= _GROW:
            return self._read_exact(n)
        out = bytearray()
        while len(out) < n:
            piece = min(n - len(out), max(_GROW, len(out)))  # (doubling: few reallocations)
            at = len(out)
            out.extend(bytes(piece))  # (zeroes only what the next recv fills)
            self._read_into(memoryview(out)[at:])
        return out

    def _read_into(self, target: memoryview) -> None:
        have = min(self._end - self._start, len(target))
        target[:have] = self._view[self._start:self._start + have]
        self._start += have
        if have < len(target):
            recv_into_all(self.sock, target[have:])


def check_header(magic: bytes, nbufs: int, plen: int,
                 max_message: int = DEFAULT_MAX_MESSAGE) -> None:
    """The fixed header is a frame's (shared by every channel that carries frames)."""
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r})")
    if nbufs > MAX_BUFFERS or plen > max_message:
        raise FrameError(f"frame header out of range: {nbufs} buffers, {plen} payload bytes "
                         f"(max_message_size {max_message})")


def check_lengths(plen: int, lengths: tuple[int, ...],
                  max_message: int = DEFAULT_MAX_MESSAGE) -> None:
    total = plen + sum(lengths)
    if total > max_message:
        raise FrameError(f"frame of {total} bytes is above max_message_size ({max_message}); "
                         "raise TensorPipeRpcBackendOptions.max_message_size on the receiver "
                         "to accept it")


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
