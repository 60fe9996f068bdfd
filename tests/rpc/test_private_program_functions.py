"""The program's own private helpers are not callable from a peer (issue 46 point 5): a function
or class whose name (or a part of whose qualified name) starts with ``_``, in a module of the
program found by rule 2 of [Note: allow-list] (rpc/trust/callables.py: a module beside the script or
in the working directory), resolves only once registered (``@rpc.register``,
``allowed_modules``). The attack: ``spyhooks._spy_system``, a private wrapper of ``os.system``
in a module beside the victim's script, called by name from a peer.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import socket
import sys

import pytest

from shardwise.rpc.trust import callables
from shardwise.rpc.trust.callables import ForbiddenCallable, is_allowed_class, resolve
from tests.harness import procs

SPYHOOKS = '''
import os

def _spy_system(cmd):
    return os.system(cmd)

def double(x):
    return 2 * x

class Tools:
    @staticmethod
    def _hidden(cmd):
        return os.system(cmd)

    @staticmethod
    def shown(x):
        return x + 1

class _Secret:
    pass
'''

PROGRAM = '''
import json
import sys

import shardwise.rpc as rpc
import spyhooks

rank, port, out, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
if rank == 0:
    got = {}
    for name, fn, args in (("private", spyhooks._spy_system, (f"touch {marker}",)),
                           ("private-method", spyhooks.Tools._hidden, (f"touch {marker}",)),
                           ("public", spyhooks.double, (21,)),
                           ("public-method", spyhooks.Tools.shown, (41,))):
        try:
            got[name] = ["ok", rpc.rpc_sync("w1", fn, args=args)]
        except Exception as exc:
            got[name] = [type(exc).__name__, str(exc)]
    with open(out, "w") as f:
        json.dump(got, f)
rpc.shutdown()
'''


@pytest.fixture
def spyhooks(tmp_path, monkeypatch):
    """``spyhooks``, a module of the program (its root: the directory holding it), imported."""
    root = tmp_path / "prog"
    root.mkdir()
    (root / "spyhooks.py").write_text(SPYHOOKS)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(callables, "_program", dict(callables._program))
    monkeypatch.setattr(callables, "_program_modules", {})
    monkeypatch.setattr(callables, "_modules", set(callables._modules))
    monkeypatch.setattr(callables, "_registry", dict(callables._registry))
    monkeypatch.setattr(callables, "_names", dict(callables._names))
    callables.set_program_roots([str(root)])
    yield importlib.import_module("spyhooks")
    sys.modules.pop("spyhooks", None)


def test_private_functions_of_a_program_module_are_refused(spyhooks):
    assert resolve("spyhooks:double") is spyhooks.double  # the program's public function
    assert resolve("spyhooks:Tools.shown") is spyhooks.Tools.shown
    for name in ("_spy_system", "Tools._hidden", "_Secret"):
        with pytest.raises(ForbiddenCallable, match=rf"spyhooks\.{name}: it is private .*"
                                                    r"@shardwise\.rpc\.register .*"
                                                    r"allowed_modules=\['spyhooks'\]"):
            resolve(f"spyhooks:{name}")
    assert not is_allowed_class(spyhooks._Secret) and is_allowed_class(spyhooks.Tools)


def test_a_registered_private_function_resolves(spyhooks):
    callables.register(spyhooks._spy_system)
    assert resolve("spyhooks:_spy_system") is spyhooks._spy_system
    with pytest.raises(ForbiddenCallable, match="private"):
        resolve("spyhooks:Tools._hidden")  # one registered function allows no other


def test_allowed_modules_allow_its_private_functions(spyhooks):
    callables.register_module("spyhooks")
    assert resolve("spyhooks:_spy_system") is spyhooks._spy_system
    assert resolve("spyhooks:Tools._hidden") is spyhooks.Tools._hidden
    assert is_allowed_class(spyhooks._Secret)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_cannot_call_the_private_wrapper_of_os_system(tmp_path):
    """Two programs (the same script beside ``spyhooks.py``); rank 0 calls rank 1's private
    helpers by name: refused, naming the function and how to allow it; no command ran; the
    public ones answer."""
    root = tmp_path / "prog"
    root.mkdir()
    (root / "spyhooks.py").write_text(SPYHOOKS)
    (root / "victim.py").write_text(PROGRAM)
    out, marker, port = tmp_path / "got.json", tmp_path / "pwned", str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDWISE_RPC_SECRET=secrets.token_hex(16),
               PYTHONPATH=os.pathsep.join([str(procs.ROOT), str(procs.ROOT / "src")]))
    programs = [procs.start([str(root / "victim.py"), str(r), port, str(out), str(marker)],
                            env, root) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in programs]
    finally:
        for p in programs:
            p.kill()
    assert [p.returncode for p in programs] == [0, 0], logs
    got = json.loads(out.read_text())
    assert not marker.exists(), got
    for name, qualname in (("private", "_spy_system"), ("private-method", "Tools._hidden")):
        kind, message = got[name]
        assert kind == "ForbiddenCallable", got
        assert f"spyhooks.{qualname}: it is private" in message and "register" in message, got
    assert got["public"] == ["ok", 42] and got["public-method"] == ["ok", 42], got
