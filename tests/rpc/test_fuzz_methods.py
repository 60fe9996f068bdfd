"""Fuzzed RRef method names (rule 5 of [Note: allow-list], rpc/trust/methods.py): thousands of names
and chains on the values a worker can own (tensors, parameters, modules, optimizers, numpy
arrays, storages, classes, functions, modules, program objects with instance attributes).

Every name outside the pure set and the program's own methods is refused before anything is
called; the names that resolve are called with fuzzed arguments; none runs a program (patched
os.system / subprocess / exec*), writes a file (the working directory is a fresh empty one) or
hangs (an alarm per call). The bulk calls the resolver in-process; a few dozen go over a real
connection.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import string

import numpy as np
import pytest
import torch
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc.rrefs.rref import invoke_method
from shardwise.rpc.trust.callables import ForbiddenCallable
from shardwise.rpc.trust.methods import PURE_METHODS, resolve_method
from tests.rpc import helpers

N_RANDOM = 500
NEVER = ("numpy", "tofile", "dump", "dumps", "from_file", "untyped_storage", "storage",
         "_storage", "share_memory_", "share_memory", "save", "__reduce__", "__reduce_ex__",
         "__setattr__", "__getattribute__", "__getattr__", "__class__", "__dict__", "__init__",
         "__setstate__", "__init_subclass__", "__subclasses__", "register_hook", "apply",
         "_apply", "apply_", "map_", "cuda", "pin_memory", "register_forward_hook",
         "register_forward_pre_hook", "register_full_backward_hook", "add_module",
         "get_submodule", "__globals__", "mro", "tobytes", "ctypes", "data_ptr",
         "_typed_storage", "new_empty", "resize_", "set_", "__array__", "__deepcopy__",
         "register_step_pre_hook", "add_param_group", "type", "__torch_function__")
CHAIN_STEPS = ("clone", "detach", "t", "float", "contiguous", "cpu", "sum", "flatten")


def _values():
    param = nn.Parameter(torch.ones(3))
    return [torch.ones(3), param, torch.arange(6).reshape(2, 3), nn.Linear(2, 2),
            nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.optim.SGD([param], lr=0.1),
            np.arange(4, dtype=np.uint8), torch.ones(3).untyped_storage(),
            helpers.Tracked(helpers.echo), helpers.BatchSum(2), torch.optim.SGD, os,
            helpers.echo, {"a": 1}, "text", 3]


def _names(rng: random.Random, values: list) -> list:
    names = set(NEVER)
    for v in values:
        names.update(dir(type(v)))
        names.update(n for n in dir(v) if isinstance(n, str))
    for names_of in PURE_METHODS.values():
        names.update(names_of)
        names.update(n + "_" for n in names_of)
        names.update("_" + n for n in names_of)
        names.update(f"__{n}__" for n in names_of)
    alphabet = string.ascii_letters + string.digits + "_."
    for _ in range(N_RANDOM):
        size = rng.randint(0, 24)
        names.add("".join(rng.choice(alphabet) for _ in range(size)))
    return [*sorted(names), None, 3, b"numpy", ("numpy",), "x" * 5000, "to\x00file", "ñumpy"]


def _expected(value, name) -> bool:
    """Whether rule 5 allows ``name`` on ``value`` (checked against the resolver)."""
    if not isinstance(name, str) or not name.isidentifier():
        return False
    if name.startswith("_") and name not in ("__call__", "__getitem__", "__len__"):
        return False
    if type(value) in (helpers.Tracked, helpers.BatchSum):  # program classes: own methods
        return name in vars(type(value)) and callable(vars(type(value))[name])
    return any(isinstance(value, base) and name in names
               for base, names in PURE_METHODS.items())


def _args(rng: random.Random, tmp) -> tuple:
    pool = [0, 1, -1, 2, 10**6, 0.5, True, None, str(tmp / "written"), "cpu", "meta", "cuda",
            torch.float64, torch.ones(3), torch.zeros(2, 2), (1, 3), "numpy"]
    return tuple(rng.choice(pool) for _ in range(rng.randint(0, 2)))


@pytest.fixture
def no_code(program_starts, monkeypatch, tmp_path):
    """Every way to a shell or a new program records the attempt; a fresh empty cwd."""
    monkeypatch.chdir(tmp_path)
    yield program_starts, tmp_path


def _alarm(signum, frame):
    raise TimeoutError("a method call hung")


def _try(value, name, args) -> bool:
    """Resolve and (if allowed) call; returns whether the name resolved."""
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        try:
            bound = resolve_method(value, name)
        except ForbiddenCallable:
            return False
        # (a pure method may refuse its fuzzed arguments)
        with contextlib.suppress(TypeError, ValueError, RuntimeError, IndexError, KeyError,
                                 AttributeError, ForbiddenCallable, NotImplementedError,
                                 OverflowError):
            bound(*args)
        return True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


@pytest.mark.filterwarnings("ignore")  # (torch's deprecation warnings for fuzzed overloads)
def test_fuzzed_method_names_never_reach_files_or_code(no_code):
    calls, tmp = no_code
    rng = random.Random(2511)
    values = _values()
    names = _names(rng, values)
    old = signal.signal(signal.SIGALRM, _alarm)
    cases = allowed = 0
    try:
        for value in values:
            for name in names:
                resolved = _try(value, name, _args(rng, tmp))
                assert resolved == _expected(value, name), (type(value), name)
                assert not (resolved and name in NEVER), (type(value), name)
                cases += 1
                allowed += resolved
        for _ in range(1000):  # chains: pure steps on a fresh tensor, then a fuzzed name
            value = torch.arange(6.0).reshape(2, 3)
            for step in rng.sample(CHAIN_STEPS, rng.randint(1, 3)):
                value = resolve_method(value, step)()
            name = rng.choice(names)
            assert _try(value, name, _args(rng, tmp)) == _expected(value, name), name
            cases += 1
    finally:
        signal.signal(signal.SIGALRM, old)
    assert calls == [] and list(tmp.iterdir()) == []
    assert cases > 10_000 and 0 < allowed < cases / 10, (cases, allowed)


def test_fuzzed_method_names_over_a_connection(rpc_world, tmp_path):
    rng = random.Random(25)
    owned = [rpc.remote("worker1", torch.ones, args=(3,)),
             rpc.remote("worker1", helpers.ndarray_of, args=(4,)),
             rpc.remote("worker1", helpers.make_linear, args=(0, 2, 2)),
             rpc.remote("worker1", helpers.Tracked, args=(helpers.echo,))]
    target = str(tmp_path / "written")
    for name in rng.sample(NEVER, 24) + ["value", "to\x00file", "x" * 300]:
        rref = rng.choice(owned)
        with pytest.raises(ForbiddenCallable):
            rpc.rpc_sync("worker1", invoke_method, args=(name, rref, (target,), {}))
    assert list(tmp_path.iterdir()) == []
    assert torch.equal(owned[0].to_here(), torch.ones(3))  # still serving, value unchanged
