"""A pickle rebuilds data only: BUILD never changes a function, class or global; tensors and
numpy arrays only as dense data that fits the bytes received; nesting bounded; nn.Module
instances of imported classes as data ([Note: pickle scan], [Note: data classes]).

The BUILD attacks below changed a worker's functions before the fix (``add()`` returned the
attacker's default over a real connection); each must now be refused with an error naming
the target, and the target must be unchanged afterwards.
"""

from __future__ import annotations

import pickle
import struct
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc import agent as agent_module
from shardwise.rpc.current import get_agent
from shardwise.rpc.messages import Kind
from shardwise.rpc.options import WorkerInfo
from shardwise.rpc.trust import callables, serialization
from shardwise.rpc.trust.serialization import Session, dumps, loads
from tests.rpc import helpers, netlike


# ------------------------------------------------------------------ a small pickle assembler
def s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def glob(module: str, name: str) -> bytes:
    return s(module) + s(name) + b"\x93"  # STACK_GLOBAL


def k(n: int) -> bytes:
    return b"K" + bytes([n])  # BININT1


def d(*pairs: tuple[bytes, bytes]) -> bytes:
    """A dict of already-pickled keys and values."""
    return b"}(" + b"".join(key + value for key, value in pairs) + b"u"


def slots(state: bytes) -> bytes:
    return b"N" + state + b"\x86"  # (None, slotstate): setattr per key


def pk(body: bytes) -> bytes:
    return b"\x80\x05" + body + b"."


def _loads(data: bytes, buffers=()):
    return loads(data, list(buffers), Session(None, 0))


def _round_trip(value):
    payload, buffers = dumps(value, Session(None, 0))
    return loads(payload, [np.frombuffer(bytes(b), np.uint8).copy() for b in buffers],
                 Session(None, 0))


HELPERS = "tests.rpc.helpers"
DEFAULTS = slots(d((s("__defaults__"), k(100) + b"\x85")))
KWDEFAULTS = slots(d((s("__kwdefaults__"), d((s("scale"), k(100)))),))


# ------------------------------------------------------------------ BUILD on what exists
def test_build_on_a_function_over_a_connection_is_refused(rpc_world, monkeypatch):
    """A peer's pickle sets ``__defaults__`` / ``__kwdefaults__`` of an allowed function."""
    real = agent_module.dumps
    for state in (DEFAULTS, KWDEFAULTS):
        # (None, None, ("tests.rpc.helpers:echo", (<add with state>,), {}, None))
        crafted = pk(b"NN(" + s(f"{HELPERS}:echo") + glob(HELPERS, "add") + state + b"b\x85}Nt"
                     + b"\x87")

        def fake(obj, session, crafted=crafted):
            payload, buffers = real(obj, session)
            return (crafted, buffers) if obj[2] == "marker" else (payload, buffers)

        monkeypatch.setattr(agent_module, "dumps", fake)
        agent = get_agent()
        with pytest.raises(Exception, match=r"BUILD.*tests\.rpc\.helpers\.add"):
            agent.request(agent.worker("worker1").id, Kind.CALL, "marker", 30, "raw").wait()
        monkeypatch.setattr(agent_module, "dumps", real)
        assert rpc.rpc_sync("worker1", helpers.add, args=(1,)) == 2
        assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3
    assert helpers.add.__defaults__ == (1,) and helpers.add.__kwdefaults__ == {"scale": 1}


def _refused(data: bytes, match: str) -> None:
    with pytest.raises(pickle.UnpicklingError, match=match):
        _loads(data)


def test_build_on_globals_is_refused_and_changes_nothing():
    from shardwise.rpc.trust.serialization import _rebuild_tensor

    add = helpers.add
    before = (add.__defaults__, dict(add.__kwdefaults__), dict(vars(add)))
    target = glob(HELPERS, "add")
    for body in (
        target + DEFAULTS + b"b",                                   # on the global
        target + KWDEFAULTS + b"b",
        target + d((s("x"), k(1))) + b"b",                          # dict state: add.__dict__
        target + b"\x94" + b"0" + b"h\x00" + DEFAULTS + b"b",       # memoized, fetched back
        target + b"2" + DEFAULTS + b"b" + b"0",                     # DUP
        glob(HELPERS, "identity") + target + b"\x85R" + DEFAULTS + b"b",  # a call's result
    ):
        _refused(pk(body), r"BUILD.*(tests\.rpc\.helpers\.(add|identity))")
    assert (add.__defaults__, add.__kwdefaults__, vars(add)) == before
    assert add(1) == 2

    rebuild = glob("shardwise.rpc.trust.serialization", "_rebuild_tensor")
    _refused(pk(rebuild + KWDEFAULTS + b"b"), r"BUILD.*_rebuild_tensor")
    assert _rebuild_tensor.__kwdefaults__ is None and vars(_rebuild_tensor) == {}

    info = glob("shardwise.rpc.options", "WorkerInfo")
    for state in (slots(d((s("name"), s("evil")), (s("evil"), k(1)))),
                  slots(d((s("__eq__"), glob(HELPERS, "identity"))))):
        _refused(pk(info + state + b"b"), r"BUILD.*WorkerInfo")
    assert "evil" not in vars(WorkerInfo) and WorkerInfo.__eq__ is not helpers.identity
    assert WorkerInfo("w", 1) == WorkerInfo("w", 1)

    # classes and data globals of the unpickler
    forward = nn.Linear.forward
    _refused(pk(glob("torch.nn.modules.linear", "Linear")
                + slots(d((s("forward"), glob(HELPERS, "identity")))) + b"b"), "BUILD.*Linear")
    _refused(pk(glob("torch", "float16") + slots(d((s("x"), k(1)))) + b"b"), "BUILD.*float16")
    assert nn.Linear.forward is forward and not hasattr(torch.float16, "x")


def test_build_on_fresh_instances_follows_the_rules():
    linear = glob("torch.nn.modules.linear", "Linear")
    new = linear + b")\x81"  # NEWOBJ Linear()
    # a fresh instance of a data class with a plain dict state: accepted
    got = _loads(pk(new + d((s("in_features"), k(3))) + b"b"))
    assert type(got) is nn.Linear and got.in_features == 3
    # twice on one instance, a dunder key, a (state, slots) pair with __class__
    _refused(pk(new + b"\x94" + d() + b"b" + b"0h\x00" + d() + b"b"), "twice")
    _refused(pk(new + d((s("__class__"), k(1))) + b"b"), "plain attribute names")
    _refused(pk(new + b"N" + d((s("__class__"), glob(HELPERS, "Tracked"))) + b"\x86b"),
             "plain attribute names")
    _refused(pk(new + b"]b"), "plain attribute names")  # a list as state
    # an instance of something that is not a data class: a tensor, a dtype, an OrderedDict
    _refused(pk(glob("torch", "Size") + b")\x85R" + d((s("a"), k(1))) + b"b"),
             "torch.Size instance.*not a class")
    # a new OrderedDict keeps its attributes (a state_dict's _metadata), plain ones only
    od = glob("collections", "OrderedDict") + b")R"
    assert _loads(pk(od + d((s("_metadata"), k(1))) + b"b"))._metadata == 1
    _refused(pk(od + d((s("__class__"), k(1))) + b"b"), "plain attribute names")
    _refused(pk(glob("torch", "device") + s("cpu") + b"\x85R" + d() + b"b"),
             "torch.device instance.*__new__")
    _refused(pk(glob("torch.optim.sgd", "SGD") + b")\x81" + d() + b"b"),
             "SGD instance.*not a data class")


def test_opcodes_the_pickler_never_makes_are_refused():
    add = glob(HELPERS, "add")
    for data, name in ((b"\x80\x05(i" + f"{HELPERS}\nTracked\n".encode() + b".", "INST"),
                       (b"\x80\x05(" + glob(HELPERS, "Tracked") + b"o.", "OBJ"),
                       (b"\x80\x05\x82\x01.", "EXT1"), (b"\x80\x05\x83\x01\x00.", "EXT2"),
                       (b"\x80\x05\x84\x01\x00\x00\x00.", "EXT4"),
                       (b"\x80\x05" + add + b"\x94g0\n.", "GET"),
                       (b"\x80\x05Pabc\n.", "PERSID"), (b"\x80\x05" + s("x") + b"Q.", "BINPERSID")):
        _refused(data, name)


class _SetsState(nn.Module):
    calls: list = []

    def __setstate__(self, state):
        _SetsState.calls.append(state)
        super().__setstate__(state)


class _OwnNew:
    singleton: _OwnNew | None = None

    def __new__(cls, *args):
        if cls.singleton is None:
            cls.singleton = super().__new__(cls)
        return cls.singleton


class _PlainData:
    def __init__(self, a=0):
        self.a = a


class _OwnSetstate(_PlainData):
    def __setstate__(self, state):
        self.__dict__.update(state, via_setstate=True)


@pytest.fixture
def library_module():
    """``fakevision_models``: an imported library module, neither registered nor allowed."""
    mod = types.ModuleType("fakevision_models")
    init_calls: list = []

    class Net(nn.Module):
        def __init__(self, marker=None):
            super().__init__()
            init_calls.append(marker)
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    class Hooked(nn.Module):
        def __reduce_ex__(self, protocol):
            return super().__reduce_ex__(protocol)

    class NotAModule:
        pass

    for cls in (Net, Hooked, NotAModule, _SetsState):
        cls = cls if cls is not _SetsState else type("SetsState", (_SetsState,), {})
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
    sys.modules[mod.__name__] = mod
    yield mod, init_calls
    del sys.modules[mod.__name__]


def test_modules_of_imported_libraries_rebuild_as_data_only(library_module):
    mod, init_calls = library_module
    net = mod.Net("sender")
    got = _round_trip({"net": net})["net"]
    assert type(got) is mod.Net and init_calls == ["sender"]  # no __init__ on the receiver
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(),
                                                 net.state_dict().values()))
    x = torch.randn(3, 2)
    assert torch.equal(got(x), net(x))
    # the class itself: never called (its __init__ would run), never a value
    net_cls = glob("fakevision_models", "Net")
    _refused(pk(net_cls + s("receiver") + b"\x85R"), "fakevision_models.Net")
    _refused(pk(net_cls), "fakevision_models.Net")
    _refused(pk(net_cls + b"\x94)\x81" + d() + b"b0h\x00"), "fakevision_models.Net")
    assert init_calls == ["sender"]
    # overridden pickling or __setstate__, not a module, never imported: refused
    for name in ("Hooked", "NotAModule", "SetsState"):
        _refused(pk(glob("fakevision_models", name) + b")\x81" + d() + b"b"), name)
    _refused(pk(glob("fakevision_other", "Net") + b")\x81" + d() + b"b"), "fakevision_other")
    assert "fakevision_other" not in sys.modules and _SetsState.calls == []
    # what a module's state holds goes through the allow-list: a hook that is not allowed
    _refused(pk(net_cls + b")\x81" + d((s("_forward_hooks"), d((k(0), glob("os", "system")))))
                + b"b"), "os.system")


def test_setstate_of_program_classes_needs_registration(monkeypatch):
    mod = types.ModuleType("rpc_prog_mod")
    for cls in (_PlainData, _OwnSetstate, _OwnNew):
        monkeypatch.setattr(cls, "__module__", mod.__name__)
        setattr(mod, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(callables, "_modules", callables._modules | {mod.__name__})
    assert _round_trip(_PlainData(5)).a == 5
    own = glob(mod.__name__, "_OwnSetstate") + b")\x81" + d((s("a"), k(7))) + b"b"
    _refused(pk(own), "__setstate__")
    monkeypatch.setattr(callables, "_registry", dict(callables._registry))
    monkeypatch.setattr(callables, "_names", dict(callables._names))
    rpc.register(_OwnSetstate)  # (into the copies: undone with the test)
    assert _loads(pk(own)).via_setstate
    # a class whose __new__ hands out an existing object: never given a state
    single = _OwnNew()
    for op in (b")\x81", b")R"):
        _refused(pk(glob(mod.__name__, "_OwnNew") + op + d((s("a"), k(9))) + b"b"), "__new__")
    assert not hasattr(single, "a")


# ------------------------------------------------------------------ depth
@pytest.mark.parametrize("opener, closer", [(b"]", b"a"), (b"}" + s("k"), b"s"),
                                            (b"(", b"t"), (b"", b"\x85")])
def test_deep_nesting_is_a_named_error(opener, closer):
    levels = 100_000
    body = b"N"
    if opener == b"(":  # tuples from marks: ( ( ( ... N t t t
        data = pk(b"(" * levels + b"N" + b"t" * levels)
    elif opener == b"":
        data = pk(body + b"\x85" * levels)
    else:  # containers first, then each goes into the one below it
        data = pk(b"]" + (opener * levels) + b"N" + closer * levels + b"a")
    with pytest.raises(serialization.pickle_rules.PickleTooDeep, match="deeper than 256"):
        _loads(data)


def test_deep_nesting_through_the_memo_is_a_named_error():
    # each level: a new list holding the previous one fetched from the memo (stack stays small)
    body = b"]\x94"
    for i in range(3000):
        body += b"0]" + (b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)) \
            + b"a\x94"
    with pytest.raises(serialization.pickle_rules.PickleTooDeep):
        _loads(pk(body))


def test_nested_objects_count_as_levels():
    module = nn.Identity()
    for _ in range(150):  # each level: a Sequential and its _modules dict
        module = nn.Sequential(module)
    with pytest.raises(serialization.pickle_rules.PickleTooDeep):
        _round_trip(module)


def test_nesting_within_the_bound_and_shared_parts_are_data():
    value = []
    for _ in range(200):
        value = [value]
    assert _round_trip(value) == value
    shared = [[i] for i in range(400)]  # many containers, shallow: measured, accepted
    assert _round_trip({"a": shared, "b": shared}) == {"a": shared, "b": shared}
    loop = []
    loop.append(loop)
    got = _round_trip(loop)
    assert got[0] is got


# ------------------------------------------------------------------ tensors
def _tensor_pickle(dtype, shape, nbytes: int, requires_grad=False, buf=None) -> tuple:
    args = (buf if buf is not None else pickle.PickleBuffer(bytearray(nbytes)), dtype, shape,
            requires_grad, False)
    rebuild = glob("shardwise.rpc.trust.serialization", "_rebuild_tensor")

    class R:
        def __reduce__(self):
            return serialization._rebuild_tensor, args

    payload, buffers = dumps(R(), Session(None, 0))
    assert rebuild[-10:-1] in payload
    return payload, [np.frombuffer(bytes(b), np.uint8).copy() for b in buffers]


@pytest.mark.parametrize("dtype, shape, nbytes, match", [
    ("float32", (-1, -4), 16, "shape"), ("float32", (2**70, 0), 0, "shape"),
    ("float32", (2**40, 2**40, 0), 0, "does not fit"), ("float32", (2, 2), 15, "does not fit"),
    ("float32", (2.0,), 8, "shape"), ("float32", [2], 8, "shape"), ("float32", (True,), 4,
                                                                      "shape"),
    ("qint8", (4,), 4, "dtype"), ("object", (1,), 8, "dtype"), ("Tensor", (1,), 8, "dtype"),
    ("float", (1,), 4, "dtype"), (3, (1,), 4, "dtype"), ("int64", (1,), 8, "grad"),
])
def test_tensor_rebuild_refuses_what_is_not_dense_data(dtype, shape, nbytes, match):
    payload, buffers = _tensor_pickle(dtype, shape, nbytes, requires_grad=match == "grad")
    with pytest.raises(serialization.BadTensorData, match=match):
        loads(payload, buffers, Session(None, 0))


def test_tensor_buffer_must_be_bytes():
    payload, buffers = _tensor_pickle("uint8", (3,), 3, buf=[1, 2, 3])
    with pytest.raises(serialization.BadTensorData, match="bytes"):
        loads(payload, buffers, Session(None, 0))


def test_dense_tensors_of_every_sent_dtype_round_trip():
    for dtype in (torch.bfloat16, torch.float16, torch.uint16, torch.uint64, torch.bool,
                  torch.complex64, torch.float8_e4m3fn):
        t = torch.arange(6).reshape(2, 3).to(dtype)
        got = _round_trip(t.t())
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8) if dtype.itemsize == 1
                                                  and dtype != torch.bool else got,
                                                  (t.t().contiguous().view(torch.uint8)
                                                   if dtype.itemsize == 1 and dtype != torch.bool
                                                   else t.t()))


# ------------------------------------------------------------------ numpy
NP_DTYPES = ("float16", "float32", "float64", "complex64", "complex128", "int8", "int16",
             "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")


def test_numpy_arrays_round_trip_as_data():
    rng = np.random.default_rng(0)
    for name in NP_DTYPES:
        a = (rng.standard_normal((4, 5)) * 50).astype(name)
        for variant in (a, a[:, ::2], a.T, np.asfortranarray(a), a[1:, 1:], a[0, 0],
                        np.array(a[0, 0]), a[:0], np.empty((0, 3), name)):
            got = _round_trip({"x": variant})["x"]
            assert type(got) is type(variant) and got.dtype == variant.dtype
            assert got.shape == np.shape(variant) and np.array_equal(got, variant)
    # bytes that arrive unaligned for the dtype are copied into a writable array
    payload, buffers = dumps(np.arange(3.0), Session(None, 0))
    unaligned = np.zeros(25, np.uint8)[1:]
    unaligned[:] = np.frombuffer(bytes(buffers[0]), np.uint8)
    got = loads(payload, [unaligned], Session(None, 0))
    assert np.array_equal(got, np.arange(3.0)) and got.flags.writeable
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    got = _round_trip(big_endian)
    assert got.dtype == np.dtype("int32") and np.array_equal(got, big_endian)


def test_numpy_arrays_never_rebuild_through_numpy():
    with pytest.raises(TypeError, match="numeric and bool"):
        dumps(np.array([1, "a"], dtype=object), Session(None, 0))
    with pytest.raises(TypeError, match="numeric and bool"):
        dumps(np.array(["ab"]), Session(None, 0))
    for module in ("numpy._core.multiarray", "numpy.core.multiarray", "numpy._core.numeric",
                   "numpy"):
        for name in ("_reconstruct", "_frombuffer", "load", "fromfile", "frombuffer",
                     "ndarray", "dtype", "scalar", "loads"):
            _refused(pk(glob(module, name)), f"{module}.{name}")
    # numpy's own pickles of an array (protocol 5 out of band, and in band) are refused
    a = np.arange(4.0)
    bufs = []
    for data in (pickle.dumps(a, protocol=5, buffer_callback=bufs.append),
                 pickle.dumps(a, protocol=4)):
        with pytest.raises(pickle.UnpicklingError, match="numpy"):
            _loads(data, [np.frombuffer(bytes(b), np.uint8) for b in bufs])
    # our rebuild function with a dtype it does not take, or bytes that do not fit
    rebuild = glob("shardwise.rpc.trust.serialization", "_rebuild_ndarray")
    for dtype, shape in (("object", (1,)), ("O", (1,)), ("<U1", (1,)), ("float128", (1,)),
                         ("float64", (2,)), ("float64", (-1,))):
        with pytest.raises(serialization.BadTensorData):
            _loads(pk(rebuild + b"C\x08" + bytes(8) + s(dtype)
                      + (k(shape[0]) if shape[0] >= 0 else b"J\xff\xff\xff\xff") + b"\x85"
                      + b"\x87R"))


# ------------------------------------------------------------------ over a connection
def test_numpy_and_library_modules_cross_a_connection(rpc_world):
    arrays = {"f": np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1::2], "b": np.bool_(True),
              "i": np.int64(7), "e": np.empty((0, 2), np.uint8), "s": np.float64(2.5)}
    got = rpc.rpc_sync("worker1", helpers.identity, args=(arrays,))
    for key, value in arrays.items():
        assert type(got[key]) is type(value) and np.array_equal(got[key], value)
    rref = rpc.remote("worker1", helpers.make_netlike, args=(3,))
    net = rref.to_here()
    want = netlike.make(3)
    assert type(net) is netlike.TinyResNet
    x = torch.randn(2, 1, 5, 5)
    assert torch.equal(net(x), want(x))
    back = rpc.rpc_sync("worker1", helpers.identity, args=(net,))
    assert torch.equal(back(x), want(x))
