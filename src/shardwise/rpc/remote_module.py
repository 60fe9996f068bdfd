"""RemoteModule: a module that lives on another worker, called like a local one.

Same constructor and methods as ``torch.distributed.nn.RemoteModule``:
``RemoteModule("worker1/cpu", nn.Linear, args=(4, 2))`` creates the module on ``worker1`` (with
``remote()``, so the constructor does not wait for it); ``forward`` / ``__call__`` run its
``forward`` there with ``rpc_sync``, ``forward_async`` with ``rpc_async``; inside a distributed
autograd context the calls join the graph, so ``remote_parameters()`` (RRefs to the remote
parameters) can be given to :class:`DistributedOptimizer`. A RemoteModule may be sent in an RPC
(its module RRef is forked to the receiver). Methods that would need the parameters here
(``parameters``, ``to``, ``state_dict``, hooks, ...) raise ValueError, as in torch;
``train`` / ``eval`` act on the remote module. Scripted interfaces (torch's private
``_module_interface_cls``) are not supported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.rpc import api
from shardwise.rpc.current import get_agent
from shardwise.rpc.rrefs.rref import RRef
from shardwise.rpc.trust.callables import register, require_class
from shardwise.rpc.trust.methods import resolve_method
from shardwise.rpc.trust.serialization import current_session

__all__ = ["RemoteModule"]

def parse_remote_device(remote_device: str) -> tuple[str | int, torch.device]:
    """``"worker1/cuda:0"``, ``"rank:1/cpu"`` or ``"worker1"`` (on its CPU) -> (worker name or
    rank, device), as torch's ``_remote_device``."""
    if not isinstance(remote_device, str) or remote_device.count("/") > 1:
        raise ValueError(f"remote_device must look like 'worker_name/device', "
                         f"'rank:<rank>/device' or 'worker_name'; got {remote_device!r}")
    worker, _, device = remote_device.partition("/")
    if not device and _is_device(worker):
        raise ValueError(f"remote_device {remote_device!r} names a device but no worker; "
                         "write 'worker_name/device' or 'rank:<rank>/device'")
    if not worker:
        raise ValueError(f"remote_device {remote_device!r} names no worker")
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"bad device in remote_device {remote_device!r}: {exc}") from None
    if worker.startswith("rank:"):
        try:
            return int(worker[len("rank:"):]), dev
        except ValueError:
            raise ValueError(f"bad rank in remote_device {remote_device!r}") from None
    return worker, dev


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


@register
def _create_module(module_cls: type, args: tuple, kwargs: dict, device: str) -> nn.Module:
    """Runs on the owner: build the module and move it to its device. ``module_cls`` must be
    an ``nn.Module`` class, checked before anything runs ([Note: allow-list] rule 5)."""
    require_class(module_cls, nn.Module, "RemoteModule's module_cls")
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(f"RemoteModule: module_cls(*args, **kwargs) must return an nn.Module, "
                         f"got {type(module).__name__}")
    return module.to(device)


@register
def _param_rrefs(module_rref: RRef, recurse: bool) -> list[RRef]:
    """Runs on the owner: one owner RRef per parameter (the parameters themselves)."""
    parameters = resolve_method(module_rref.local_value(), "parameters")
    return [RRef(p) for p in parameters(recurse)]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


@register
def _remote_forward(module_rref: RRef, device: str, is_device_map_set: bool, args: tuple,
                    kwargs: dict) -> Any:
    """Runs on the owner: ``module.forward`` on the module's device. Without a device map to
    the caller only CPU tensors may travel, so CUDA results come back on the CPU (torch's
    rule)."""
    forward = resolve_method(module_rref.local_value(), "forward")
    dev = torch.device(device)
    if dev.type != "cuda":
        return forward(*args, **kwargs)
    out = forward(*_to(args, dev), **_to(kwargs, dev))
    return out if is_device_map_set else _to(out, torch.device("cpu"))


@register
def _rebuild(on: str | int, device: str, module_rref: RRef) -> RemoteModule:
    """The receiving side of an RPC that carried a RemoteModule."""
    module = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(module)
    module._setup(on, torch.device(device), module_rref, current_session().hooks)
    return module


def _unsupported(name: str, hint: str = "") -> None:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule{hint}")


class RemoteModule(nn.Module):
    """``RemoteModule(remote_device, module_cls, args=None, kwargs=None)`` as in torch."""

    def __init__(self, remote_device: str, module_cls: type[nn.Module],
                 args: tuple | None = None, kwargs: dict[str, Any] | None = None,
                 _module_interface_cls: Any = None) -> None:
        super().__init__()
        if _module_interface_cls is not None:
            raise NotImplementedError("RemoteModule: scripted module interfaces "
                                      "(_module_interface_cls) are not supported")
        require_class(module_cls, nn.Module, "RemoteModule's module_cls")
        on, device = parse_remote_device(remote_device)
        agent = get_agent()
        rref = api.remote(on, _create_module,
                          args=(module_cls, tuple(args or ()), dict(kwargs or {}), str(device)))
        self._setup(on, device, rref, agent)

    def _setup(self, on: str | int, device: torch.device, module_rref: RRef, agent) -> None:
        self.on, self.device = on, str(device)
        self.module_rref = module_rref
        self.is_scriptable = False
        owner = agent.worker(on).name
        self.is_device_map_set = bool(agent.device_maps.get(owner))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule over an existing module RRef (shares the module, no copy)."""
        if _module_interface_cls is not None:
            raise NotImplementedError("RemoteModule: scripted module interfaces are not "
                                      "supported")
        on, device = parse_remote_device(remote_device)
        if module_rref.owner().name != get_agent().worker(on).name:
            raise ValueError(f"module_rref is owned by {module_rref.owner().name!r}, not by "
                             f"the remote_device's worker {on!r}")
        module = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(module)
        module._setup(on, device, module_rref, get_agent())
        return module

    # ------------------------------------------------------------------ calls
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The remote module's ``forward`` on its worker (``rpc_sync``)."""
        return self.forward_async(*args, **kwargs).wait()

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        """The remote module's ``forward`` on its worker, as a future (``rpc_async``)."""
        return api.rpc_async(self.on, _remote_forward,
                             args=(self.module_rref, self.device, self.is_device_map_set,
                                   args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        """RRefs to the remote module's parameters (for DistributedOptimizer)."""
        return api.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef:
        """The RRef of the remote ``nn.Module``."""
        return self.module_rref

    def train(self, mode: bool = True):
        """Set the remote module's training mode; returns it (a copy, as in torch)."""
        return self.module_rref.rpc_sync().train(mode)

    def eval(self):
        return self.module_rref.rpc_sync().eval()

    def __reduce__(self) -> tuple:
        current_session()  # only inside an RPC message, as torch
        return _rebuild, (self.on, self.device, self.module_rref)

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r})"

    # ------------------------------------------------------------------ not here
    def parameters(self, recurse: bool = True):
        _unsupported("parameters", ". Please use ``remote_parameters`` instead.")

    def register_buffer(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("register_buffer")

    def register_parameter(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("register_parameter")

    def add_module(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("add_module")

    def apply(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("apply")

    def cuda(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("cuda")

    def cpu(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("cpu")

    def type(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("type")

    def float(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("float")

    def double(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("double")

    def half(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("half")

    def bfloat16(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("bfloat16")

    def to(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("to")

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("register_backward_hook")

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("register_forward_pre_hook")

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("register_forward_hook")

    def state_dict(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("state_dict")

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("load_state_dict")

    def named_parameters(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("named_parameters")

    def buffers(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("buffers")

    def named_buffers(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("named_buffers")

    def children(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("children")

    def named_children(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("named_children")

    def modules(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("modules")

    def named_modules(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("named_modules")

    def requires_grad_(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("requires_grad_")

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("zero_grad")

    def share_memory(self, *args: Any, **kwargs: Any) -> None:
        _unsupported("share_memory")
