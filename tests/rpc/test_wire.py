"""Frames through FrameReader: batches of small frames and large ones, intact and in order."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from shardwise.rpc.wire import frames as wire
from tests.rpc.pairs import sessions


def _frames() -> list[tuple[bytes, list[np.ndarray]]]:
    rng = np.random.default_rng(0)
    frames = []
    for i in range(400):
        payload = bytes([i % 256]) * int(rng.choice([0, 5, 300, 70_000, 300_000]))
        sizes = rng.choice([0, 1, 1024, 50_000, 1 << 20], size=int(rng.integers(0, 4)))
        frames.append((payload, [np.full(int(n), (i + k) % 256, np.uint8)
                                 for k, n in enumerate(sizes)]))
    return frames


def test_reader_returns_every_frame_intact_and_in_order():
    frames = _frames()
    a, b = socket.socketpair()
    tx, rx = sessions()

    def send() -> None:
        with a:
            for payload, bufs in frames:
                wire.send_frame(a, payload, [memoryview(x) for x in bufs], tx)

    sender = threading.Thread(target=send)
    sender.start()
    reader, got = wire.FrameReader(b, rx, 1), []
    with pytest.raises(wire.PeerClosed) as closed:
        while True:
            got.extend(reader.next_batch())
    sender.join()
    b.close()
    assert not closed.value.truncated
    assert len(got) == len(frames)
    for (payload, bufs), (got_payload, got_bufs) in zip(frames, got):
        assert bytes(got_payload) == payload
        assert len(got_bufs) == len(bufs)
        assert all(np.array_equal(x, y) for x, y in zip(bufs, got_bufs))


def test_reader_rejects_a_bad_header_and_reports_a_truncated_frame():
    a, b = socket.socketpair()
    a.sendall(b"XXXX" + bytes(12))
    with pytest.raises(wire.FrameError):
        wire.FrameReader(b, sessions()[1], 1).next_batch()
    a.close()
    b.close()
    a, b = socket.socketpair()
    a.sendall(wire.frame_parts(b"payload", [])[0][:-3])
    a.close()
    with pytest.raises(wire.PeerClosed) as closed:
        wire.FrameReader(b, sessions()[1], 1).next_batch()
    assert closed.value.truncated
    b.close()
