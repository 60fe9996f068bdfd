"""10,000 random and mutated frames and pickles through the decoder: each is refused (an error)
or decodes to plain data; none runs code (marker file, patched os.system / subprocess / exec),
none hangs (an alarm per input) and none makes the decoder allocate what was not sent."""

from __future__ import annotations

import collections
import random
import signal
import struct

import numpy as np
import pytest
import torch

from shardwise.rpc.trust.serialization import Session, dumps, loads
from shardwise.rpc.wire import FrameReader, frame_parts
from tests.rpc.pairs import sessions

N_PICKLES = 7000
N_FRAMES = 3000
DANGEROUS = [("os", "system"), ("posix", "system"), ("subprocess", "Popen"),
             ("builtins", "eval"), ("builtins", "exec"), ("builtins", "getattr"),
             ("builtins", "__import__"), ("torch._utils", "_import_dotted_name"),
             ("torch.storage", "_load_from_bytes"), ("torch", "load"), ("torch", "save"),
             ("torch.fx.graph_module", "_exec_with_source"), ("operator", "attrgetter"),
             ("operator", "methodcaller"), ("torch.serialization", "os.system"),
             ("shardwise.rpc.trust.serialization", "pickle.loads"), ("io", "open"),
             ("runpy", "run_path"), ("importlib", "import_module"), ("pty", "spawn")]
PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, slice, torch.Tensor,
         torch.dtype, torch.device, torch.layout, torch.Size)


class _Bytes:
    """A socket stand-in that yields ``data`` in random pieces, then EOF."""

    def __init__(self, data: bytes, rng: random.Random):
        self.data, self.at, self.rng = data, 0, rng

    def recv_into(self, view, n: int = 0) -> int:
        n = min(n or len(view), len(view), len(self.data) - self.at, self.rng.randint(1, 1 << 16))
        view[:n] = self.data[self.at:self.at + n]
        self.at += n
        return n


def _plain(value, depth: int = 0) -> bool:
    if depth > 50:
        return False
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, (dict, collections.OrderedDict)):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _seeds(marker: str) -> list[tuple[bytes, list]]:
    session = Session(None, 0)
    values = [
        (None, None, ("tests.rpc.helpers:add", (torch.ones(3),), {"k": 1.5}, None)),
        (7, 3, {"x": torch.arange(12).reshape(3, 4).t(), "y": [1, "a", b"b", (2.5, None)]}),
        (None, None, ("builtins:ValueError", "boom", "Traceback ...")),
        (None, None, collections.OrderedDict(a=torch.zeros(2, dtype=torch.bfloat16),
                                             b=torch.device("cpu"), c=torch.Size([2]))),
        (None, None, [complex(1, 2), slice(1, 5, 2), {1, 2}, frozenset({3}), torch.float16]),
    ]
    seeds = []
    for v in values:
        payload, buffers = dumps(v, session)
        seeds.append((payload, [np.frombuffer(bytes(b), np.uint8).copy() for b in buffers]))
    command = f"touch {marker}".encode()
    for module, name in DANGEROUS:  # the classic payloads: GLOBAL + REDUCE, STACK_GLOBAL
        glob = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        seeds.append((b"\x80\x02" + glob + b"X" + struct.pack("<I", len(command)) + command
                      + b"\x85R.", []))
        seeds.append((b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c"
                      + bytes([len(name)]) + name.encode() + b"\x93\x8c"
                      + bytes([len(command)]) + command + b"\x85R.", []))
    return seeds


def _mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op == 2:
            del data[at:at + rng.randint(1, 16)]
        elif op == 3:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 4:
            module, name = rng.choice(DANGEROUS)
            data[at:at] = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        else:
            data = data[:at]
    return bytes(data)


@pytest.fixture
def no_code(program_starts, tmp_path):
    """Every way to a shell or a new program records the attempt instead of running."""
    yield program_starts, tmp_path / "marker"


def _alarm(signum, frame):
    raise TimeoutError("decoder hung on one input")


def _decode(payload: bytes, buffers: list) -> tuple[bool, bool]:
    """(refused, plain data)"""
    try:
        value = loads(payload, buffers, Session(None, 0))
    except TimeoutError:
        raise
    except Exception:  # noqa: BLE001 - refused: any error is the expected outcome
        return True, False
    return False, _plain(value)


def test_fuzzed_pickles_and_frames_never_run_code(no_code):
    calls, marker = no_code
    rng = random.Random(1234)
    seeds = _seeds(str(marker))
    old = signal.signal(signal.SIGALRM, _alarm)
    refused = decoded = 0
    try:
        for i in range(N_PICKLES):
            payload, buffers = rng.choice(seeds)
            data = _mutate(payload, rng) if i % 10 else bytes(rng.randrange(256)
                                                               for _ in range(rng.randint(0, 64)))
            signal.setitimer(signal.ITIMER_REAL, 5.0)
            was_refused, plain = _decode(data, list(buffers))
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert was_refused or plain, f"input {i} decoded to something not plain data"
            refused += was_refused
            decoded += not was_refused
        for i in range(N_FRAMES):
            payload, buffers = rng.choice(seeds)
            frame = b"".join(bytes(p) for p in frame_parts(b"\x01" + b"\x00" * 8 + payload,
                                                           [memoryview(b) for b in buffers]))
            data = _mutate(frame, rng) if i % 4 else _mutate(frame[:21], rng) + frame[21:]
            tx, rx = sessions()  # (sealed after the damage: a member's hostile frame)
            data += tx.tag_out([data])
            reader = FrameReader(_Bytes(data, rng), rx, 1, max_message=1 << 24)
            signal.setitimer(signal.ITIMER_REAL, 5.0)
            try:
                while True:
                    for got, bufs in reader.next_batch():
                        was_refused, plain = _decode(bytes(got)[9:], bufs)
                        assert was_refused or plain
            except (ConnectionError, struct.error, ValueError, MemoryError):
                pass  # the connection is dropped: refused
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert calls == [] and not marker.exists()
    assert refused > 0.9 * N_PICKLES  # (the rest are mutations that stayed plain data)
    # every classic payload naming a dangerous global, unmutated, is refused
    for payload, buffers in seeds[5:]:
        assert _decode(payload, buffers) == (True, False)
