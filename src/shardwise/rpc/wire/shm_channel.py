"""The shared-memory channel between two authenticated workers on one host.

[Note: shm channel] Once a connection has passed the group's handshake (auth.py), both ends
run :func:`negotiate` over it: each sends a hello (channel mode, the kernel's boot id, its
user id, a fresh nonce, its ring size). When both run on one kernel as one user and neither
asked for TCP, each creates the ring it will write into (shm_ring.py) under a name derived from
both nonces, and maps the peer's ring after checking the file; a failure on either side (for
example another /dev/shm in a container) leaves both on TCP, unless one of them asked for
``shm`` (``SHARDWISE_RPC_CHANNEL=shm``), which is then an error. The socket stays open: it is
the doorbell (one byte wakes a peer that sleeps, see [Note: shm ring]) and its closing is how a
peer's death is noticed, as on the TCP channel.

Frames in the ring use the wire format of wire.py, and the reader checks every header with the
same functions and limits as the socket reader. The hellos and status bytes of the negotiation
and every frame carry the session's MAC ([Note: session MAC] in session.py), so a relay on the
socket cannot make the ends fall back to TCP or speak in the ring; a frame's large buffers are
covered through their digests, which the sender computes while it copies them out and the
reader computes over the region it maps, before the frame is handed on.

A buffer of at least ``SEGMENT_MIN`` bytes does not go through the ring: the sender writes it
once into the pool ([Note: shm pool]) or a segment of its own (a file in /dev/shm written by
the kernel from the tensor's memory), and the receiver maps that segment and unlinks it; the
mapping becomes the received tensor's memory, so its bytes are copied once in all. The n-th
such buffer on a connection is segment ``<id>-<side>-<n>``: names carry no data the peer could
choose. Sending follows the TCP connection's rule (transport.py): a sender queues its frame,
and whoever holds the send lock writes everything queued, then rings once.

Wake-ups: who reads, and when a reader polls instead of sleeping, is the connection's
business ([Note: reading role] in connection.py); the ring's part is the sleeping flag. A
reader that finds the ring empty sets it before it sleeps on the socket, and clears it while it
polls. A writer that finds the ring full waits on an event that the reader sets when the
peer's doorbell says space was freed (and re-checks every few milliseconds, so nothing can wait
forever).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import uuid
from collections.abc import Callable

import numpy as np

from shardwise.distributed.env import choice_var, int_var
from shardwise.distributed.host.segment import stores_in_order
from shardwise.rpc.wire import shm_ring
from shardwise.rpc.wire.connection import Defer, FrameHandler, LostHandler, QueuedConnection
from shardwise.rpc.wire.frames import (
    _FIXED,
    DEFAULT_MAX_MESSAGE,
    MAGIC,
    TAG,
    FrameError,
    PeerClosed,
    check_header,
    check_lengths,
    recv_exact,
)
from shardwise.rpc.wire.shm_pool import PAGE, PoolError, PoolReader, PoolWriter, pool_bytes
from shardwise.rpc.wire.shm_ring import Ring, SegmentError

log = logging.getLogger("shardwise.rpc")

ENV = "SHARDWISE_RPC_CHANNEL"
MODES = ("auto", "tcp", "shm")
RING_BYTES = 4 << 20  # per direction
SEGMENT_MIN = 256 << 10  # buffers this large go through the pool or a segment of their own
POOL_BYTES = int_var("SHARDWISE_RPC_SHM_POOL_MB", 256, minimum=0) * (1 << 20)  # per direction;
# 0: a segment per large buffer
MAX_RING, MAX_POOL = 1 << 30, 1 << 40
NO_SLOT = 0xFFFFFFFF  # descriptor of a buffer in a segment of its own
_DESCRIPTOR = struct.Struct("!IIQ")  # pool slot (or NO_SLOT), 0, offset in the pool
_HELLO = struct.Struct("!4sB16sI16sQQQ")  # magic, mode, boot, uid, nonce, ring, seg min, pool
_HELLO_MAGIC = b"SWC1"
_DATA, _SPACE = b"D", b"S"  # doorbell bytes: "your incoming ring has data" / "has space"
_JOIN = 64 << 10  # frames up to this are joined into one piece before the ring
_GROW = 1 << 20  # payloads above this are read into memory that grows as they arrive
_SPACE_POLL = 0.005  # a writer waiting for space re-checks this often (seconds)


class ChannelError(ConnectionError):
    """The shared-memory channel was required but could not be set up."""


def channel_mode() -> str:
    """The channel to use: ``$SHARDWISE_RPC_CHANNEL`` (one of MODES), else ``auto``."""
    return choice_var(ENV, MODES, "auto")


def boot_id() -> bytes:
    """This kernel's boot id (16 bytes; zeros where unknown, which never matches)."""
    try:
        text = open("/proc/sys/kernel/random/boot_id").read().strip()  # noqa: SIM115
        return uuid.UUID(text).bytes
    except (OSError, ValueError):
        return bytes(16)


# ---------------------------------------------------------------------- negotiation
class ShmLink:
    """The two mapped segments of one connection (ring and pool per direction) and the
    names of its segments."""

    def __init__(self, conn_id: str, me: str, peer: str):
        self.prefix = f"{shm_ring.PREFIX}{conn_id}-"
        self.me, self.peer = me, peer
        self.tx: Ring | None = None
        self.rx: Ring | None = None
        self.tx_pool: PoolWriter | None = None
        self.rx_pool: PoolReader | None = None
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []

    def ring_name(self, side: str) -> str:
        return f"{self.prefix}{side}-ring"

    def create_tx(self, sizes: tuple[int, int]) -> None:
        capacity, pool = sizes
        size = Ring.segment_size(capacity) + pool_bytes(pool)
        fd = shm_ring.create_file(self.ring_name(self.me))
        try:
            os.ftruncate(fd, size)  # (pages are allocated as they are first written)
            mm = shm_ring.map_file(fd, size)
        finally:
            os.close(fd)
        ring_view, pool_view = self._views_of(mm, capacity)
        self.tx = Ring(ring_view, capacity, init=True)
        base = Ring.segment_size(capacity) + PAGE  # the pool's data in the segment

        def drop(offset: int, length: int) -> None:
            mm.madvise(mmap.MADV_REMOVE, base + offset, length)

        self.tx_pool = PoolWriter(pool_view, pool, drop if hasattr(mmap, "MADV_REMOVE")
                                  else None)

    def map_rx(self, sizes: tuple[int, int]) -> None:
        capacity, pool = sizes
        mm = shm_ring.open_mapped(self.ring_name(self.peer),
                                  Ring.segment_size(capacity) + pool_bytes(pool),
                                  populate=False)
        ring_view, pool_view = self._views_of(mm, capacity)
        self.rx = Ring(ring_view, capacity, init=False)
        self.rx_pool = PoolReader(pool_view, pool)

    def _views_of(self, mm: mmap.mmap, capacity: int) -> tuple[memoryview, memoryview]:
        self._maps.append(mm)
        whole = memoryview(mm)
        ring_view = whole[:Ring.segment_size(capacity)]
        pool_view = whole[Ring.segment_size(capacity):]
        self._views += [whole, ring_view, pool_view]
        return ring_view, pool_view

    def close(self) -> None:
        """Unmap what no received tensor still uses (those keep their mapping) and unlink
        every segment of the connection that still has a name."""
        for part in (self.tx, self.rx, self.tx_pool):
            if part is not None:
                part.close()
        self.tx = self.rx = self.tx_pool = self.rx_pool = None
        for view in reversed(self._views):
            with contextlib.suppress(BufferError):  # arrays over the peer's pool still live
                view.release()
        for mm in self._maps:
            with contextlib.suppress(BufferError):  # arrays over the peer's pool still live
                mm.close()
        self._views, self._maps = [], []
        shm_ring.remove_all(self.prefix)


def negotiate(sock: socket.socket, mode: str, acceptor: bool, timeout: float, session,
              peer: int) -> ShmLink | None:
    """Agree on the channel over a freshly authenticated socket (both ends call this; every
    message sealed with ``session``, whose peer is rank ``peer``).

    Returns the mapped rings for the shared-memory channel, or None for TCP."""
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        return _negotiate(_Sealed(sock, session, peer), mode, acceptor)
    except PeerClosed as exc:
        raise ChannelError(f"peer closed the connection while choosing the channel: {exc}") \
            from exc
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(old)


class _Sealed:
    """The negotiation's messages over the socket, each with the session's tag."""

    def __init__(self, sock: socket.socket, session, peer: int):
        self.sock, self.session, self.peer = sock, session, peer

    def sendall(self, message: bytes) -> None:
        self.sock.sendall(self.session.seal(message))

    def recv(self, n: int) -> bytes:
        return self.session.open(recv_exact(self.sock, n + TAG), self.peer)


def _negotiate(sock: _Sealed, mode: str, acceptor: bool) -> ShmLink | None:
    nonce = secrets.token_bytes(16)
    sock.sendall(_HELLO.pack(_HELLO_MAGIC, MODES.index(mode), boot_id(), os.geteuid(), nonce,
                             RING_BYTES, SEGMENT_MIN, POOL_BYTES))
    magic, peer_mode, peer_boot, peer_uid, peer_nonce, peer_ring, peer_seg, peer_pool = \
        _HELLO.unpack(sock.recv(_HELLO.size))
    if magic != _HELLO_MAGIC or peer_mode >= len(MODES):
        raise ChannelError(f"bad channel hello from the peer (magic {bytes(magic)!r})")
    modes = {mode, MODES[peer_mode]}
    if "tcp" in modes:
        if "shm" in modes:
            raise ChannelError("one end asked for the shm RPC channel, the other for tcp")
        return None
    reason = _shm_impossible(peer_boot, peer_uid, peer_ring, peer_seg, peer_pool)
    if reason is None:
        first, second = (nonce, peer_nonce) if acceptor else (peer_nonce, nonce)
        conn_id = hashlib.sha256(b"shardwise-rpc-shm" + first + second).hexdigest()[:24]
        link = ShmLink(conn_id, *("ac" if acceptor else "ca"))
        reason = _map_rings(sock, link, (peer_ring, peer_pool))
        if reason is None:
            return link
    if "shm" in modes:
        raise ChannelError(f"the shm RPC channel was asked for but cannot be used: {reason}")
    log.debug("shardwise.rpc: using TCP to a peer: %s", reason)
    return None


def _shm_impossible(peer_boot: bytes, peer_uid: int, peer_ring: int, peer_seg: int,
                    peer_pool: int):
    if peer_boot != boot_id() or peer_boot == bytes(16):
        return "the peer runs on another host"
    if not stores_in_order():  # both ends share this machine, so both decide alike
        return "this machine may show stores out of order ([Note: memory ordering on one host])"
    if peer_uid != os.geteuid():
        return f"the peer runs as user {peer_uid}, this worker as {os.geteuid()}"
    if peer_seg != SEGMENT_MIN or not 4096 <= peer_ring <= MAX_RING \
            or peer_ring & (peer_ring - 1) or peer_pool % 4096 or peer_pool > MAX_POOL:
        return "the peer's shared-memory parameters differ (another shardwise version?)"
    return None


def _map_rings(sock: _Sealed, link: ShmLink, peer_sizes: tuple[int, int]) -> str | None:
    """Create our segment, map the peer's; both ends report each step. None when both worked."""
    try:
        error = _attempt(link.create_tx, (RING_BYTES, POOL_BYTES))
        peer_error = _exchange_status(sock, error)
        if error is None and peer_error is None:
            error = _attempt(link.map_rx, peer_sizes)
            peer_error = _exchange_status(sock, error)
        if error is None and peer_error is None:
            shm_ring.unlink(link.ring_name(link.me))  # both mapped it (the peer unlinked too)
            return None
    except BaseException:
        link.close()
        raise
    link.close()
    return error or f"the peer could not set up shared memory ({peer_error})"


def _attempt(step: Callable[[tuple[int, int]], None], arg: tuple[int, int]) -> str | None:
    try:
        step(arg)
    except Exception as exc:  # noqa: BLE001 - reported to the peer, then TCP or an error
        return f"{type(exc).__name__}: {exc}"
    return None


def _exchange_status(sock: _Sealed, error: str | None) -> str | None:
    sock.sendall(b"\x01" if error is None else b"\x00")
    return None if sock.recv(1)[0] == 1 else "failed"


# ---------------------------------------------------------------------- the connection


class ShmClosed(ConnectionError):
    """The shared-memory connection to the peer is closed."""


class ShmConnection(QueuedConnection):
    """A connection whose frames travel through shared memory; the socket only rings."""

    closed_error = ShmClosed
    reader_name = "shardwise-rpc-shm-reader"

    def __init__(self, sock: socket.socket, peer: int, link: ShmLink, session,
                 on_frame: FrameHandler, on_lost: LostHandler,
                 max_message: int = DEFAULT_MAX_MESSAGE, defer: Defer | None = None):
        super().__init__(sock, peer, on_frame, on_lost, max_message, defer)
        self.link, self.session = link, session  # [Note: session MAC] in session.py
        self.tx, self.rx, self.tx_pool, self.rx_pool = link.tx, link.rx, link.tx_pool, \
            link.rx_pool
        self._written = 0  # bytes written to tx (published or not)
        self._tx_seq = 0  # segments named so far (under send_lock)
        self._rx_seq = 0
        self._consumed = 0  # bytes read from rx
        self._temp = itertools.count()
        self.sent_lent = self.sent_segments = 0  # large buffers sent through each path
        self._space = threading.Event()
        self._eof = False
        self._start_reader()

    # ------------------------------------------------------------------ sending
    def _frame(self, payload: bytes, buffers: list[memoryview]
               ) -> tuple[list, list[str], list[bytes]]:
        """The frame's ring parts, its large buffers copied into the pool or, where the pool
        has no room, written into temporary segments, and their digests (tagged with the
        frame, not sent)."""
        views = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers]
        head = _FIXED.pack(MAGIC, len(views), len(payload))
        if views:
            head += struct.pack(f"!{len(views)}Q", *[len(v) for v in views])
        parts: list = []
        temps: list[str] = []
        digests: list[bytes] = []
        try:
            for view in views:
                if len(view) >= SEGMENT_MIN:
                    head += self._hand_over(view, temps, digests)
                elif len(view):
                    parts.append(view)
        except BaseException:
            for name in temps:
                shm_ring.unlink(name)
            raise
        if len(payload) + sum(len(p) for p in parts) <= _JOIN:  # one copy into the ring
            return [b"".join([head, payload, *parts])], temps, digests
        return [head, memoryview(payload), *parts], temps, digests

    def _hand_over(self, view: memoryview, temps: list[str], digests: list[bytes]) -> bytes:
        """Put a large buffer where the reader will find it, hashing each piece as it is
        copied (in cache); returns its descriptor."""
        mac = self.session.buffer_hasher(outgoing=True)
        lent = self.tx_pool.alloc(len(view))
        if lent is None:
            temps.append(self._write_segment(view, mac))
            self.sent_segments += 1
            digests.append(mac.digest(TAG))
            return _DESCRIPTOR.pack(NO_SLOT, 0, 0)
        self.sent_lent += 1
        slot, offset = lent
        try:
            self.tx_pool.write(offset, view)
        except PoolError as exc:
            raise ShmClosed(f"connection to rank {self.peer} closed while sending") from exc
        mac.update(view)  # (one call: hashed on several cores)
        digests.append(mac.digest(TAG))
        return _DESCRIPTOR.pack(slot, 0, offset)

    def _write_segment(self, view: memoryview, mac) -> str:
        name = f"{self.link.prefix}{self.link.me}-t{next(self._temp)}"
        fd = shm_ring.create_file(name)
        try:
            shm_ring.write_file(fd, view)
            mac.update(view)
        except BaseException:
            shm_ring.unlink(name)
            raise
        finally:
            os.close(fd)
        if self.closed:  # the reader may have cleaned the connection's names already
            shm_ring.unlink(name)
            raise ShmClosed(f"connection to rank {self.peer} closed while sending")
        return name

    def _send_queued(self) -> None:
        queue, ring = self._queue, self.tx
        try:
            if self.closed:  # the last reader may have unmapped the ring
                raise ShmClosed(f"connection to rank {self.peer} is closed")
            while queue:
                parts, temps, digests = queue.popleft()
                for temp in temps:  # the next names in the stream's order
                    name = f"{self.link.prefix}{self.link.me}-{self._tx_seq}"
                    os.rename(shm_ring.path_of(temp), shm_ring.path_of(name))
                    self._tx_seq += 1
                    if self.closed:  # closing removed the names before this one came
                        shm_ring.unlink(name)
                        raise ShmClosed(f"connection to rank {self.peer} is closed")
                tag = self.session.tag_out([*parts, *digests])  # (in the order sent)
                for part in parts:
                    self._write(ring, memoryview(part))
                self._write(ring, memoryview(tag))
            if ring.publish(self._written):
                self._ring_bell(_DATA)
        except (OSError, ShmClosed) as exc:
            for _parts, temps, _digests in queue:
                for temp in temps:
                    shm_ring.unlink(temp)
            queue.clear()
            self._lost(exc, clean=False)

    def _write(self, ring: Ring, part: memoryview) -> None:
        done, total = 0, len(part)
        while done < total:
            space = ring.space(self._written)
            if space == 0:
                self._wait_for_space(ring)
                continue
            n = min(space, total - done)
            self._written = ring.copy_in(self._written, part[done:done + n])
            done += n
            if done < total and ring.publish(self._written):  # let the reader start on it
                self._ring_bell(_DATA)

    def _wait_for_space(self, ring: Ring) -> None:
        if ring.publish(self._written):
            self._ring_bell(_DATA)
        while not self.closed:
            self._space.clear()
            if not ring.writer_waits(self._written):
                return
            self._space.wait(_SPACE_POLL)
            if ring.space(self._written) > 0:
                return
        raise ShmClosed(f"connection to rank {self.peer} closed while sending")

    def _ring_bell(self, byte: bytes) -> None:
        self.sock.send(byte)

    # ------------------------------------------------------------------ receiving
    def _drain(self) -> list:
        """Every whole frame in the ring ([Note: reading role]); the peer's close is an error
        once the frames it wrote before closing have been read."""
        frames = []
        while not self.closed and self.rx.available(self._consumed):
            frames.append(self._next_frame())
        if not frames and self._eof:
            raise PeerClosed("peer closed the connection", truncated=False)
        return frames

    def _woken(self) -> None:
        self._take_bells()
        self.rx.reader_awake()

    def _may_sleep(self) -> bool:
        if self._eof:
            return False
        block, wake = self.rx.reader_sleeps(self._consumed)
        if wake:
            self._ring_bell(_SPACE)
        return block

    def _spin_start(self) -> None:
        self.rx.reader_awake()  # a reader that polls the ring needs no doorbell

    def _take_bells(self) -> None:
        """Read the doorbell bytes that are waiting, without blocking."""
        while True:
            try:
                data = self.sock.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not self._bells(data):
                return

    def _next_frame(self) -> tuple[bytes | bytearray, list[np.ndarray]]:
        """Read one frame, checked exactly as the socket reader checks it (wire.py)."""
        frame = self._take_whole()
        if frame is not None:
            return frame
        fixed = self._read(_FIXED.size, start=True)
        magic, nbufs, plen = _FIXED.unpack(fixed)
        check_header(magic, nbufs, plen, self.max_message)
        sizes = self._read(8 * nbufs) if nbufs else b""
        lengths = struct.unpack(f"!{nbufs}Q", sizes) if nbufs else ()
        check_lengths(plen, lengths, self.max_message)
        large = sum(n >= SEGMENT_MIN for n in lengths)
        places = self._read(_DESCRIPTOR.size * large) if large else b""
        payload = self._read(plen)
        tagged = [fixed, sizes, places, payload]
        buffers, digests, at = [], [], 0
        for n in lengths:
            if n < SEGMENT_MIN:
                buffers.append(self._array(n))
                tagged.append(buffers[-1])
                continue
            slot, _, offset = _DESCRIPTOR.unpack_from(places, at)
            at += _DESCRIPTOR.size
            buffers.append(self._segment(n) if slot == NO_SLOT else self._lent(slot, offset, n))
            mac = self.session.buffer_hasher(outgoing=False)
            mac.update(buffers[-1])
            digests.append(mac.digest(TAG))
        self.session.check_in(tagged + digests, self._read(TAG), self.peer)
        if self.rx.release(self._consumed):
            self._ring_bell(_SPACE)
        return payload, buffers

    def _take_whole(self) -> tuple[bytes, list[np.ndarray]] | None:
        """The next frame in one piece, if all of it is in the ring without wrapping around
        and it has no large buffers (most small messages); else None."""
        ring, at = self.rx, self._consumed
        have = ring.available(at)
        if have < _FIXED.size:
            return None
        view = ring.peek(at, have)
        if len(view) < _FIXED.size:
            return None
        magic, nbufs, plen = _FIXED.unpack_from(view)
        check_header(magic, nbufs, plen, self.max_message)
        head = _FIXED.size + 8 * nbufs
        if len(view) < head:
            return None
        lengths = struct.unpack_from(f"!{nbufs}Q", view, _FIXED.size) if nbufs else ()
        check_lengths(plen, lengths, self.max_message)
        size = head + plen + sum(lengths) + TAG
        if len(view) < size or any(n >= SEGMENT_MIN for n in lengths):
            return None
        self.session.check_in([view[:size - TAG]], view[size - TAG:size], self.peer)
        payload = bytes(view[head:head + plen])
        buffers, pos = [], head + plen
        for n in lengths:
            buffers.append(np.frombuffer(view, np.uint8, n, pos).copy())
            pos += n
        self._consumed = at + size
        if ring.release(self._consumed):
            self._ring_bell(_SPACE)
        return payload, buffers

    def _read(self, n: int, start: bool = False) -> bytearray:
        if n <= _GROW:
            out = bytearray(n)
            if n:
                self._read_into(memoryview(out), start)
            return out
        out = bytearray()  # a large payload: memory grows only as its bytes arrive
        while len(out) < n:
            ring = self.rx
            have = ring.available(self._consumed)
            if have == 0:
                self._wait_for_data(ring, truncated=True)
                continue
            piece = ring.peek(self._consumed, min(have, n - len(out)))
            out += piece
            self._consumed += len(piece)
            if ring.release(self._consumed):
                self._ring_bell(_SPACE)
        return out

    def _array(self, n: int) -> np.ndarray:
        arr = np.empty(n, np.uint8)
        if n:
            self._read_into(memoryview(arr))
        return arr

    def _segment(self, n: int) -> np.ndarray:
        name = f"{self.link.prefix}{self.link.peer}-{self._rx_seq}"
        self._rx_seq += 1
        try:
            mm = shm_ring.open_mapped(name, n)
        except SegmentError as exc:
            raise FrameError(f"frame buffer of {n} bytes: {exc}") from exc
        return np.frombuffer(mm, np.uint8)  # the array owns the mapping now

    def _lent(self, slot: int, offset: int, n: int) -> np.ndarray:
        try:
            return self.rx_pool.take(slot, offset, n)
        except PoolError as exc:
            raise FrameError(f"frame buffer of {n} bytes: {exc}") from exc

    def _read_into(self, target: memoryview, start: bool = False) -> None:
        ring, done, total = self.rx, 0, len(target)
        while done < total:
            have = ring.available(self._consumed)
            if have == 0:
                self._wait_for_data(ring, truncated=not (start and done == 0))
                continue
            n = min(have, total - done)
            self._consumed = ring.copy_out(self._consumed, target[done:done + n])
            done += n
            if n >= 1 << 16 and ring.release(self._consumed):
                self._ring_bell(_SPACE)

    def _wait_for_data(self, ring: Ring, truncated: bool) -> None:
        if self._eof:
            raise PeerClosed("peer closed the connection" + (" inside a frame" if truncated
                                                             else ""), truncated=truncated)
        block, wake = ring.reader_sleeps(self._consumed)
        if wake:
            self._ring_bell(_SPACE)
        if not block:
            return
        try:
            self._wait_bell()
        finally:
            ring.reader_awake()

    def _wait_bell(self) -> None:
        self._bells(self.sock.recv(64))

    def _bells(self, data: bytes) -> bool:
        """Act on doorbell bytes; False at the peer's close (no bytes: ``recv`` saw EOF)."""
        if not data:
            self._eof = True  # frames written before the peer left are still read
            return False
        for byte in data:
            if byte == _SPACE[0]:
                self._space.set()
            elif byte != _DATA[0]:
                raise FrameError(f"unexpected byte {byte} on a shared-memory connection's "
                                 "doorbell")
        return True

    # ------------------------------------------------------------------ closing
    def _closing(self) -> None:
        """The connection's segment names go at once (also those the peer made and never saw
        read), the mappings once the readers are out (``_release``)."""
        shm_ring.remove_all(self.link.prefix)
        self._space.set()

    def _release(self) -> None:
        """After the last reader, once the connection is closed: unmap and unlink."""
        self.closed = True
        self._space.set()
        with self.send_lock:  # no sender is writing into the ring any more
            self.link.close()
