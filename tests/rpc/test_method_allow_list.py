"""Methods a peer calls on a value the worker owns go through the allow-list too ([Note:
allow-list] in rpc/trust/callables.py, rule 5; rpc/trust/methods.py).

Each attack below wrote or read a file on the worker when RRef proxy calls resolved any
attribute of the owned value; each must now be refused with a ForbiddenCallable that names the
method and the class, and the file must not exist (checked on disk).
"""

from __future__ import annotations

import site
import sys

import pytest
import torch
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc.optimizer import _new_local_optimizer, _step_local
from shardwise.rpc.remote_module import _create_module, _param_rrefs, _remote_forward
from shardwise.rpc.rrefs.rref import invoke_method
from shardwise.rpc.trust.callables import ForbiddenCallable
from tests.rpc import helpers


def _ones(n: int = 3):
    return rpc.remote("worker1", torch.ones, args=(n,))


# ------------------------------------------------------------------ the attacks of issue 25.1
def test_clone_numpy_tofile_chain_writes_no_file(rpc_world, tmp_path):
    target = tmp_path / "written.bin"
    t = _ones()
    with pytest.raises(ForbiddenCallable, match=r"numpy.*Tensor"):
        t.remote().clone().remote().numpy().rpc_sync().tofile(str(target))
    with pytest.raises(ForbiddenCallable, match=r"numpy.*Tensor"):
        t.rpc_sync().numpy()
    assert not target.exists()
    assert torch.equal(t.to_here(), torch.ones(3))  # the worker keeps serving, value unchanged


def test_ndarray_the_worker_owns_cannot_write_or_dump(rpc_world, tmp_path):
    """A library object a program function returned: data, never a handle to call methods on."""
    arr = rpc.remote("worker1", helpers.ndarray_of, args=(4,))
    for method in ("tofile", "dump"):
        with pytest.raises(ForbiddenCallable, match=rf"{method}.*ndarray"):
            getattr(arr.rpc_sync(), method)(str(tmp_path / method))
        with pytest.raises(ForbiddenCallable, match=method):
            rpc.rpc_sync("worker1", invoke_method, args=(method, arr, (str(tmp_path / method),),
                                                          {}))
    # (named through invoke_method: a proxy's own special methods run locally)
    for method in ("dumps", "tobytes", "__reduce__", "view", "ctypes", "__class__"):
        with pytest.raises(ForbiddenCallable, match=method):
            rpc.rpc_sync("worker1", invoke_method, args=(method, arr, (), {}))
    assert list(tmp_path.iterdir()) == []


def test_storage_from_file_reads_nothing(rpc_world, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"s3cr3t")
    t = _ones()
    with pytest.raises(ForbiddenCallable, match=r"untyped_storage.*Tensor"):
        storage = t.remote().untyped_storage()
        storage.remote().from_file(str(secret), False, 6).rpc_sync().tolist()
    for method in ("storage", "_storage", "share_memory_", "data_ptr", "_typed_storage"):
        with pytest.raises(ForbiddenCallable, match=method):
            getattr(t.rpc_sync(), method)()


def test_pth_into_a_site_directory_is_never_written(rpc_world, tmp_path, monkeypatch):
    """The code-execution chain: bytes of a .pth line written by ndarray.tofile into a directory
    that Python reads at start-up (here a temporary one, never the real site-packages)."""
    marker, site_dir = tmp_path / "ran", tmp_path / "site"
    site_dir.mkdir()
    line = f"import os; open({str(marker)!r}, 'w').close()\n".encode()
    payload = rpc.remote("worker1", helpers.identity,
                         args=(torch.tensor(list(line), dtype=torch.uint8),))
    with pytest.raises(ForbiddenCallable, match="numpy"):
        payload.remote().numpy().rpc_sync().tofile(str(site_dir / "evil.pth"))
    assert list(site_dir.iterdir()) == []
    monkeypatch.setattr(sys, "path", list(sys.path))
    site.addsitedir(str(site_dir))  # what the next interpreter would do with that directory
    assert not marker.exists()


def test_special_and_private_names_are_refused_and_change_nothing(rpc_world):
    t = _ones()
    for method, args in (("__reduce_ex__", (2,)), ("__setattr__", ("data", torch.zeros(3))),
                         ("__class__", ()), ("__getattribute__", ("numpy",)), ("__init__", ()),
                         ("__dict__", ()), ("__setstate__", ({},)), ("_apply", ()),
                         ("register_hook", (helpers.identity,)), ("apply_", (helpers.identity,)),
                         ("map_", (t, helpers.identity))):
        with pytest.raises(ForbiddenCallable, match=method):
            rpc.rpc_sync("worker1", invoke_method, args=(method, t, args, {}))
    assert torch.equal(t.to_here(), torch.ones(3))


def test_a_method_found_only_in_the_instance_dict_is_not_callable(rpc_world):
    """``Tracked(echo)`` keeps a function in its instance dict under ``value``: a class-dict
    lookup never finds it, so it is not callable by name."""
    tracked = rpc.remote("worker1", helpers.Tracked, args=(helpers.echo,))
    with pytest.raises(ForbiddenCallable, match=r"value.*Tracked"):
        tracked.rpc_sync().value(1)
    assert tracked.rpc_sync().get() is helpers.echo  # its class's own methods still work


def test_remote_module_class_is_checked_before_anything_runs(rpc_world, tmp_path):
    marker = tmp_path / "module_cls"
    with pytest.raises(ForbiddenCallable, match="module_cls"):
        rpc.RemoteModule("worker1/cpu", helpers.write_marker, args=(str(marker),))
    # the same request sent by hand (a peer that skips the caller's check)
    with pytest.raises(ForbiddenCallable, match="module_cls"):
        rpc.remote("worker1", _create_module,
                   args=(helpers.write_marker, (str(marker),), {}, "cpu")).to_here()
    # the invocation path as the class: ndarray.tofile through invoke_method
    arr = rpc.remote("worker1", helpers.ndarray_of, args=(4,))
    with pytest.raises(ForbiddenCallable, match="module_cls"):
        rpc.remote("worker1", _create_module,
                   args=(invoke_method, ("tofile", arr, (str(marker),), {}), {}, "cpu")
                   ).to_here()
    with pytest.raises(ForbiddenCallable, match="module_cls"):
        rpc.remote("worker1", _create_module, args=(torch.optim.SGD, (), {}, "cpu")).to_here()
    assert not marker.exists()
    # a module RRef that holds something else is not a module
    for func, args in ((_remote_forward, ("cpu", False, (1,), {})), (_param_rrefs, (True,))):
        with pytest.raises(ForbiddenCallable):
            rpc.rpc_sync("worker1", func, args=(arr, *args))


def test_distributed_optimizer_class_is_checked_before_anything_runs(rpc_world, tmp_path):
    marker = tmp_path / "optimizer_class"
    param = rpc.remote("worker1", helpers.identity, args=(nn.Parameter(torch.ones(2)),))
    for cls in (helpers.write_marker, nn.Linear, invoke_method):
        with pytest.raises(ForbiddenCallable, match="optimizer_class"):
            rpc.DistributedOptimizer(cls, [param], str(marker))
        with pytest.raises(ForbiddenCallable, match="optimizer_class"):
            rpc.remote("worker1", _new_local_optimizer,
                       args=(cls, [param], (str(marker),), {})).to_here()
    assert not marker.exists()
    with pytest.raises(ForbiddenCallable, match="DistributedOptimizer"):
        rpc.rpc_sync("worker1", _step_local, args=(param, 0))
    assert torch.equal(param.to_here(), torch.ones(2))


# ------------------------------------------------------------------ what stays allowed
def test_pure_tensor_methods_and_program_class_methods_still_work(rpc_world):
    t = rpc.remote("worker1", helpers.identity, args=(torch.arange(6.0).reshape(2, 3),))
    assert t.rpc_sync().size() == torch.Size([2, 3]) and t.rpc_sync().dim() == 2
    assert torch.equal(t.rpc_sync().sum(), torch.tensor(15.0))
    assert torch.equal(t.remote().clone().to_here(), torch.arange(6.0).reshape(2, 3))
    assert t.rpc_sync().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert t.rpc_sync().to(torch.float64).dtype == torch.float64
    assert torch.equal(t.rpc_sync().__getitem__(1), torch.tensor([3.0, 4.0, 5.0]))
    with pytest.raises(ForbiddenCallable, match="CPU"):
        t.rpc_sync().to("meta")
    tracked = rpc.remote("worker1", helpers.Tracked, args=(torch.arange(3),))
    assert torch.equal(tracked.rpc_sync().add(1, times=2), torch.arange(3) + 2)
    module = rpc.remote("worker1", helpers.make_linear, args=(0, 3, 2))
    x = torch.ones(4, 3)
    assert torch.equal(module.rpc_sync().forward(x), module.rpc_sync().__call__(x))
    assert set(module.rpc_sync().state_dict()) == {"weight", "bias"}
    assert not module.rpc_sync().eval().training
    for method in ("apply", "register_forward_hook", "share_memory", "_apply", "cuda",
                   "__setattr__", "add_module", "get_submodule", "__getattr__", "__reduce__"):
        with pytest.raises(ForbiddenCallable, match=method):
            rpc.rpc_sync("worker1", invoke_method, args=(method, module, (helpers.identity,),
                                                          {}))
