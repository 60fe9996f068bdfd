"""A peer can call only what the worker allowed ([Note: allow-list] in rpc/trust/callables.py).

Each attack below ran shell commands or wrote files on a worker under the old deny-list; every
one must now be refused with an error naming what was refused, and leave no marker file.
"""

from __future__ import annotations

import operator
import pickle
import sys
import types

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.current import get_agent
from shardwise.rpc.messages import Kind
from shardwise.rpc.trust import callables
from shardwise.rpc.trust.callables import ForbiddenCallable, resolve, resolve_global
from shardwise.rpc.trust.serialization import Session, dumps, loads
from tests.rpc import helpers


def _touch(path) -> str:
    return f"touch {path}"


def _raw_call(to: str, name: str, args: tuple):
    """A request naming ``name`` verbatim, as a malicious peer would send it."""
    agent = get_agent()
    dest = agent.worker(to).id
    return agent.request(dest, Kind.CALL, (name, args, {}, None), 30, f"raw call {name}").wait()


# ------------------------------------------------------------------ the five routes, end to end
def test_exec_with_source_is_refused(rpc_world, tmp_path):
    import torch.fx.graph_module as gm

    marker = tmp_path / "fx"
    source = f"open({str(marker)!r}, 'w').close()"
    with pytest.raises(ForbiddenCallable, match="_exec_with_source"):
        rpc.rpc_sync("worker1", gm._exec_with_source, args=(source, {}))
    with pytest.raises(ForbiddenCallable, match="_exec_with_source"):
        _raw_call("worker1", "torch.fx.graph_module:_exec_with_source", (source, {}))
    assert not marker.exists()


def test_module_attribute_path_is_refused(rpc_world, tmp_path):
    marker = tmp_path / "ser"
    for name in ("torch.serialization:os.system", "torch:serialization.os.system",
                 "torch.serialization:os", "tests.rpc.helpers:os.system",
                 "tests.rpc.helpers:identity.__globals__", "builtins:eval",
                 "tests.rpc.helpers:torch.save"):
        with pytest.raises(ForbiddenCallable, match="never resolves"):
            _raw_call("worker1", name, (_touch(marker),))
    assert not marker.exists()


def test_operator_chains_are_refused(rpc_world, tmp_path):
    marker = tmp_path / "op"
    with pytest.raises(ForbiddenCallable, match="operator.methodcaller"):
        rpc.rpc_sync("worker1", operator.methodcaller, args=("system", _touch(marker)))
    # an attrgetter / methodcaller inside an argument is refused by the unpickler
    getter = operator.attrgetter("serialization.os.system")
    with pytest.raises(RuntimeError, match="operator.attrgetter"):
        rpc.rpc_sync("worker1", helpers.identity, args=(getter,))
    with pytest.raises(RuntimeError, match="operator.methodcaller"):
        rpc.rpc_sync("worker1", helpers.identity,
                     args=(operator.methodcaller("system", _touch(marker)),))
    assert not marker.exists()


def test_torch_serialization_save_is_refused(rpc_world, tmp_path):
    marker = tmp_path / "saved.pt"
    with pytest.raises(ForbiddenCallable, match="torch.serialization.save"):
        rpc.rpc_sync("worker1", torch.serialization.save, args=({}, str(marker)))
    with pytest.raises(ForbiddenCallable, match="never resolves"):
        rpc.rpc_sync("worker1", torch.save, args=({}, str(marker)))
    assert not marker.exists()


def test_reduce_chain_in_an_argument_is_refused(rpc_world, tmp_path):
    marker = tmp_path / "arg"
    with pytest.raises(RuntimeError, match="torch._utils._import_dotted_name"):
        rpc.rpc_sync("worker1", helpers.identity, args=(helpers.RunsShell(_touch(marker)),))
    assert not marker.exists()
    # the worker answered with the error and keeps serving
    assert rpc.rpc_sync("worker1", helpers.my_name) == "worker1"


def test_reduce_chain_in_a_reply_is_refused(rpc_world, tmp_path):
    """A compromised callee cannot take over its caller through the reply."""
    marker = tmp_path / "reply"
    with pytest.raises(RuntimeError, match="could not decode the reply.*_import_dotted_name"):
        rpc.rpc_sync("worker1", helpers.evil_reply, args=(_touch(marker),))
    assert not marker.exists()
    assert rpc.rpc_sync("worker1", helpers.my_name) == "worker1"


def test_refusal_says_how_to_register(rpc_world):
    with pytest.raises(ForbiddenCallable, match=r"register.*allowed_modules=\['os'\]"):
        _raw_call("worker1", "os:getcwd", ())


# ------------------------------------------------------------------ the rule itself, in-process
@pytest.fixture
def user_module():
    """A user module ``rpc_user_mod`` that defines some functions and imports others."""
    mod = types.ModuleType("rpc_user_mod")
    source = (
        "import os\nfrom os import system\nfrom torch import save\n"
        "def double(x):\n    return 2 * x\n"
        "class Stage:\n"
        "    def run(self, x):\n        return x\n"
        "    @staticmethod\n    def helper(x):\n        return x\n"
        "    @classmethod\n    def make(cls):\n        return cls()\n"
        "alias = double\n"
    )
    exec(compile(source, "rpc_user_mod.py", "exec"), mod.__dict__)  # noqa: S102 (test module)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]
    callables._modules.discard(mod.__name__)


def test_allowed_module_resolves_only_its_own_definitions(user_module):
    with pytest.raises(ForbiddenCallable, match="register"):
        resolve("rpc_user_mod:double")  # not allowed yet
    rpc.register_module(user_module)
    assert resolve("rpc_user_mod:double") is user_module.double
    assert resolve("rpc_user_mod:Stage") is user_module.Stage
    assert resolve("rpc_user_mod:Stage.run") is user_module.Stage.run
    assert resolve("rpc_user_mod:Stage.helper") is user_module.Stage.helper
    assert resolve("rpc_user_mod:Stage.make")() .__class__ is user_module.Stage
    for name in ("os", "system", "save", "os.system", "alias", "double.__globals__",
                 "Stage.__init__", "Stage.__subclasses__", "Stage.run.__globals__",
                 "Stage.mro", "__builtins__", "__loader__"):
        with pytest.raises(ForbiddenCallable):
            resolve(f"rpc_user_mod:{name}")


def test_registered_function_and_defaults():
    def local():  # a nested function has no importable name
        return 1

    with pytest.raises(TypeError):
        rpc.register(local)
    assert resolve("torch:add") is torch.add
    assert callables.qualified_name(torch.add) == "torch:add"
    assert resolve_global("torch.nn.modules.linear", "Linear") is torch.nn.Linear
    assert resolve_global("torch.optim.sgd", "SGD") is torch.optim.SGD
    for module, name in (("torch", "load"), ("torch", "save"), ("torch", "compile"),
                         ("torch.hub", "load"), ("torch.nn.modules.module", "Module.__init__"),
                         ("subprocess", "Popen"), ("os", "system"), ("builtins", "exec"),
                         ("torch.storage", "_load_from_bytes"), ("torch._utils",
                                                                  "_rebuild_tensor_v2")):
        with pytest.raises(ForbiddenCallable):
            resolve_global(module, name)


def _unpickle(data: bytes):
    return loads(data, [], Session(None, 0))


def test_unpickler_allows_data_and_refuses_code():
    value = {"a": [1, 2.5, "x", b"y", (None, True)], "c": complex(1, 2), "s": slice(1, 4),
             "t": torch.arange(6).reshape(2, 3), "d": torch.float16, "dev": torch.device("cpu"),
             "size": torch.Size([2, 3]), "set": {1, 2}, "fs": frozenset({3})}
    payload, buffers = dumps(value, Session(None, 0))
    out = loads(payload, [memoryview(b).cast("B") for b in buffers], Session(None, 0))
    assert out["t"].equal(value["t"]) and out["size"] == value["size"]
    assert {k: v for k, v in out.items() if k != "t"} == \
        {k: v for k, v in value.items() if k != "t"}
    for module, name in (("os", "system"), ("posix", "system"), ("builtins", "eval"),
                         ("builtins", "getattr"), ("torch._utils", "_import_dotted_name"),
                         ("torch.storage", "_load_from_bytes"), ("nt", "system"),
                         ("subprocess", "Popen"), ("operator", "attrgetter"),
                         ("builtins", "bytearray"), ("torch", "load")):
        data = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."
        with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name}"):
            _unpickle(data)


def test_memo_index_opcodes_are_refused_before_unpickling():
    """A 4-byte LONG_BINPUT index made CPython's unpickler allocate and zero gigabytes."""
    for data in (b"\x80\x04K\x01r\x00\x00\x00\x40.", b"\x80\x04K\x01p999999999\n.",
                 b"\x80\x02K\x01.", b"K\x01."):
        with pytest.raises(pickle.UnpicklingError):
            _unpickle(data)


def test_rref_proxy_cannot_name_special_methods(rpc_world):
    from shardwise.rpc.rrefs.rref import invoke_method

    rref = rpc.remote("worker1", helpers.Tracked, args=(3,))
    for method in ("__setattr__", "__class__", "__reduce_ex__", "__init__"):
        with pytest.raises(ForbiddenCallable, match="special method"):
            rpc.rpc_sync("worker1", invoke_method, args=(method, rref, ("value", 5), {}))
    assert rref.to_here().value == 3


def test_spawned_main_script_is_allowed_like_main(monkeypatch):
    """multiprocessing's spawn imports the parent's script as ``__mp_main__``: its functions are
    the script's, allowed as ``__main__``'s are (benchmarks/bench_rpc.py runs this way)."""
    mod = types.ModuleType("__mp_main__")
    exec(compile("def echo(x):\n    return x\n", "script.py", "exec"), mod.__dict__)  # noqa: S102
    monkeypatch.setitem(sys.modules, "__mp_main__", mod)
    assert resolve("__mp_main__:echo") is mod.echo
    with pytest.raises(ForbiddenCallable):
        resolve("__mp_main__:compile")


def test_error_replies_rebuild_only_allowed_exception_types():
    from shardwise.rpc.messages import RemoteException, decode_exception

    assert type(decode_exception(("builtins:ValueError", "m", "tb"), "w")) is ValueError
    assert type(decode_exception(("shardwise.rpc.trust.callables:ForbiddenCallable", "m", "tb"),
                                 "w")) is ForbiddenCallable
    for info in (("os:system", "m", "tb"), ("builtins:eval", "m", "tb"),
                 ("subprocess:CalledProcessError", "m", "tb"), 5, ("a", "b")):
        assert type(decode_exception(info, "w")) is RemoteException


# the modules of rpc/trust/ and rpc/wire/ lived in rpc/ itself; their old names name nothing
_OLD_PATHS = [("shardwise.rpc.serialization", "_rebuild_tensor"),
              ("shardwise.rpc.serialization", "_rebuild_ndarray"),
              ("shardwise.rpc.callables", "register"), ("shardwise.rpc.secret", "group_key"),
              ("shardwise.rpc.transport", "Transport"), ("shardwise.rpc.methods", "PURE_METHODS")]


@pytest.mark.parametrize("module, name", _OLD_PATHS)
def test_old_module_paths_of_moved_code_stay_refused(module, name):
    data = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name}"):
        _unpickle(data)
    with pytest.raises(ForbiddenCallable):
        resolve(f"{module}:{name}")


def test_an_old_exception_path_rebuilds_no_class():
    from shardwise.rpc.messages import RemoteException, decode_exception

    info = ("shardwise.rpc.callables:ForbiddenCallable", "m", "tb")
    assert type(decode_exception(info, "w")) is RemoteException
