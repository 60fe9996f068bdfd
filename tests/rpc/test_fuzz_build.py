"""Thousands of generated pickles that try to set state (BUILD) on what a worker already has, or
to rebuild what is not data: BUILD on functions, classes, data globals and call results, through
the memo and DUP, setstate pairs, dunder keys, deep nesting, oversized or negative tensor and
array shapes, bad dtypes, numpy object arrays, data-only classes called or passed as values.
None runs code, writes a file, changes a function's ``__defaults__`` / ``__kwdefaults__`` /
``__dict__`` or a class's attributes, or hangs; each is refused or decodes to data."""

from __future__ import annotations

import random
import signal
import struct
import sys
import types

import numpy as np
import torch
from torch import nn

from shardwise.rpc.options import WorkerInfo
from shardwise.rpc.trust import serialization
from shardwise.rpc.trust.serialization import Session, loads
from tests.rpc import helpers
from tests.rpc.test_fuzz_decoder import DANGEROUS, _mutate
from tests.rpc.test_fuzz_decoder import no_code as no_code  # a fixture

N_GENERATED = 3000
N_MUTATED = 1000

SERIALIZATION = "shardwise.rpc.trust.serialization"
FUNCTIONS = [("tests.rpc.helpers", "add"), ("tests.rpc.helpers", "identity"),
             ("tests.rpc.helpers", "echo"), (SERIALIZATION, "_rebuild_tensor"),
             (SERIALIZATION, "_rebuild_ndarray"), ("torch", "add"),
             ("shardwise.rpc.rrefs.rref", "invoke_method")]
CLASSES = [("shardwise.rpc.options", "WorkerInfo"), ("torch.nn.modules.linear", "Linear"),
           ("tests.rpc.helpers", "Tracked"), ("torch.optim.sgd", "SGD"),
           ("fuzzvision", "Net"), ("fuzzvision", "OwnState"), ("collections", "OrderedDict")]
DATA = [("torch", "float16"), ("torch", "device"), ("torch", "Size"), ("builtins", "slice"),
        ("builtins", "complex"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "load"), ("numpy", "fromfile")]
KEYS = ["__defaults__", "__kwdefaults__", "__dict__", "__class__", "__code__", "forward", "x",
        "_parameters", "__setstate__", "__reduce_ex__", "name", "value", "__globals__", "id"]
DTYPES = ["float32", "int64", "bool", "uint8", "bfloat16", "object", "O", "qint8", "<U3",
          "float128", "float", "Tensor", "complex64"]


def s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def glob(name: tuple[str, str]) -> bytes:
    return s(name[0]) + s(name[1]) + b"\x93"


class _Gen:
    """Generates one pickle body (pushing one item) at a time, counting MEMOIZEs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.memo = rng, 0

    def memoize(self, body: bytes) -> bytes:
        self.memo += 1
        return body + b"\x94"

    def get(self, index: int) -> bytes:
        return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)

    def value(self, depth: int = 0) -> bytes:
        rng = self.rng
        pick = rng.randrange(9 if depth < 3 else 4)
        if pick == 0:
            return b"K" + bytes([rng.randrange(256)])
        if pick == 1:
            return s(rng.choice(KEYS))
        if pick == 2:
            return b"N"
        if pick == 3 and self.memo:
            return self.get(rng.randrange(self.memo))
        if pick == 4:
            return glob(rng.choice(FUNCTIONS + CLASSES + DATA + DANGEROUS))
        if pick == 5:
            return self.state(depth + 1)
        if pick == 6:
            return b"(" + b"".join(self.value(depth + 1) for _ in range(rng.randrange(4))) + b"t"
        if pick == 7:
            return self.target(depth + 1)
        return b"]" + b"(" + b"".join(self.value(depth + 1) for _ in range(2)) + b"e"

    def state(self, depth: int = 0) -> bytes:
        rng = self.rng
        pairs = b"".join(s(rng.choice(KEYS)) + self.value(depth + 1)
                         for _ in range(rng.randrange(1, 4)))
        plain = b"}(" + pairs + b"u"
        shape = rng.randrange(5)
        if shape == 0:
            return b"N" + plain + b"\x86"
        if shape == 1:
            return plain + plain + b"\x86"
        if shape == 2:
            return b"]" if rng.random() < 0.5 else b"N"
        return plain

    def target(self, depth: int = 0) -> bytes:
        rng = self.rng
        pick = rng.randrange(8)
        if pick == 0:
            return glob(rng.choice(FUNCTIONS + CLASSES + DATA))
        if pick == 1:
            return glob(rng.choice(CLASSES)) + b")\x81"
        if pick == 2:
            return glob(rng.choice(CLASSES + FUNCTIONS)) + b"(" + self.value(depth + 1) + b"tR"
        if pick == 3 and self.memo:
            return self.get(rng.randrange(self.memo))
        if pick == 4:
            return self.memoize(self.target(depth + 1))
        if pick == 5:
            return self.tensor() if rng.random() < 0.5 else self.array()
        if pick == 6:
            return glob(rng.choice(CLASSES)) + b")}\x92"  # NEWOBJ_EX
        return self.target(depth + 1) + b"2"  # DUP (two items: the caller's BUILD uses one)

    def dims(self) -> bytes:
        rng = self.rng
        dims = [rng.choice([0, 1, 2, 3, -1, 2**31, 2**62, 2**70]) for _ in range(rng.randrange(4))]
        return b"(" + b"".join(b"\x8a\x09" + d.to_bytes(9, "little", signed=True)
                               for d in dims) + b"t"

    def tensor(self) -> bytes:
        rng = self.rng
        return (glob((SERIALIZATION, "_rebuild_tensor")) + b"(C\x08" + bytes(8)
                + s(rng.choice(DTYPES)) + self.dims() + rng.choice([b"\x88", b"\x89", b"K\x01"])
                + b"\x89tR")

    def array(self) -> bytes:
        rng = self.rng
        return (glob((SERIALIZATION, "_rebuild_ndarray")) + b"(C\x08" + bytes(8)
                + s(rng.choice(DTYPES)) + self.dims() + b"tR")

    def pickle(self) -> bytes:
        rng = self.rng
        self.memo = 0
        kind = rng.randrange(10)
        if kind == 0:  # deep nesting, through the stack or the memo
            levels = rng.choice([300, 1000, 3000])  # (100,000: test_pickle_build)
            if rng.random() < 0.5:
                return b"\x80\x05" + b"]" * levels + b"a" * (levels - 1) + b"."
            body = b"]\x94"
            for i in range(levels):
                body += b"0]" + self.get(i) + b"a\x94"
            return b"\x80\x05" + body + b"."
        body = self.target()
        for _ in range(rng.randrange(1, 3)):
            body += self.state() + b"b"
        return b"\x80\x05" + body + b"."


def _fuzzvision():
    mod = types.ModuleType("fuzzvision")
    calls: list = []

    class Net(nn.Module):
        def __init__(self, *args):
            calls.append(("init", args))
            super().__init__()

    class OwnState(nn.Module):
        def __setstate__(self, state):
            calls.append(("setstate", state))

    for cls in (Net, OwnState):
        cls.__module__, cls.__qualname__ = "fuzzvision", cls.__name__
        setattr(mod, cls.__name__, cls)
    return mod, calls


def _snapshot() -> dict:
    funcs = [helpers.add, helpers.identity, helpers.echo, serialization._rebuild_tensor,
             serialization._rebuild_ndarray, serialization.tensor_from_buffer]
    out = {f: (f.__defaults__, f.__kwdefaults__ and dict(f.__kwdefaults__), dict(vars(f)),
               f.__code__) for f in funcs}
    # (not helpers.Tracked: its __del__ counts instances, and NEWOBJ makes some without __init__)
    for cls in (WorkerInfo, nn.Linear, torch.optim.SGD, nn.Module):
        out[cls] = dict(vars(cls))
    out["float16"] = dir(torch.float16)
    return out


def _alarm(signum, frame):
    raise TimeoutError("decoder hung on one input")


def test_fuzzed_build_states_never_change_the_worker(no_code, monkeypatch):  # noqa: F811
    calls, marker = no_code
    mod, module_calls = _fuzzvision()
    monkeypatch.setitem(sys.modules, "fuzzvision", mod)
    rng = random.Random(2525)
    gen = _Gen(rng)
    before = _snapshot()
    old = signal.signal(signal.SIGALRM, _alarm)
    refused = 0
    seeds: list[bytes] = []
    try:
        for i in range(N_GENERATED + N_MUTATED):
            if i < N_GENERATED:
                data = gen.pickle()
                if len(seeds) < 200:
                    seeds.append(data)
            else:
                data = _mutate(rng.choice(seeds), rng)
            signal.setitimer(signal.ITIMER_REAL, 5.0)
            try:
                loads(data, [np.zeros(8, np.uint8)], Session(None, 0))
            except TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - refused: the expected outcome for most
                refused += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert calls == [] and not marker.exists()
    assert module_calls == []  # a data-only class: never __init__, never its own __setstate__
    after = _snapshot()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] == value, f"{key} changed"
    assert helpers.add(1) == 2
    assert refused > 0.8 * (N_GENERATED + N_MUTATED)
