"""Payload and tensor buffers: pickle protocol 5 with tensors carried out of band.

A message becomes one pickle payload plus one raw buffer per distinct tensor. A CPU tensor's
bytes are never copied on the way out: the pickler hands the transport a memoryview of the
tensor's own memory (a non-contiguous tensor is made contiguous first, the one copy that cannot
be avoided) and the transport passes those views to ``sendmsg``. On the way in the transport
receives each buffer straight into a fresh uninitialised tensor, and the payload's tensors are
rebuilt as views of those tensors, again without a copy.

Hooks that depend on the agent (RRefs, CUDA tensors, distributed autograd) are reached through a
per-thread :class:`Session` so the module-level rebuild functions that pickle calls can find them.
"""

from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from shardwise.rpc.callables import ForbiddenCallable, resolve_global


class SerializationHooks(Protocol):
    """What the agent supplies for objects that need it (see agent.py)."""

    def reduce_rref(self, rref: Any, dest: int) -> tuple: ...
    def reduce_cuda_tensor(self, tensor: torch.Tensor, dest: int) -> tuple: ...
    def is_rref(self, obj: Any) -> bool: ...


@dataclass
class Session:
    """State of one pickling or unpickling pass (one message)."""

    hooks: SerializationHooks | None
    peer: int  # destination when pickling, source when unpickling
    grad_tensors: list[torch.Tensor] = field(default_factory=list)  # requiring grad, in order
    pending: list[Any] = field(default_factory=list)  # futures to wait for before sending


_current = threading.local()


def current_session() -> Session:
    session = getattr(_current, "session", None)
    if session is None:
        raise RuntimeError("shardwise.rpc object (un)pickled outside an RPC message")
    return session


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, session: Session, buffers: list):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._session = session

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor or kind is nn.Parameter:
            return _reduce_tensor(obj, self._session)
        hooks = self._session.hooks
        if hooks is not None and hooks.is_rref(obj):
            return hooks.reduce_rref(obj, self._session.peer)
        return NotImplemented


def _reduce_tensor(t: torch.Tensor, session: Session) -> Any:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented  # torch's own (in-band) pickling
    if t.requires_grad:
        session.grad_tensors.append(t)
    if t.device.type == "cuda":
        if session.hooks is None:
            raise RuntimeError("cannot send a CUDA tensor outside an RPC agent")
        return session.hooks.reduce_cuda_tensor(t, session.peer)
    if t.device.type != "cpu":
        raise RuntimeError(f"RPC cannot send tensors on device {t.device}")
    return _rebuild_tensor, (*cpu_buffer(t), t.requires_grad, type(t) is nn.Parameter)


def cpu_buffer(t: torch.Tensor) -> tuple[pickle.PickleBuffer, str, tuple[int, ...]]:
    """A zero-copy byte view of a CPU tensor (contiguous first if it is not), dtype, shape."""
    data = t.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    raw = data.reshape(-1).view(torch.uint8)
    return pickle.PickleBuffer(raw.numpy()), str(data.dtype).removeprefix("torch."), \
        tuple(data.shape)


def tensor_from_buffer(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor as a view of a received buffer (no copy)."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise pickle.UnpicklingError(f"unknown tensor dtype {dtype!r}")
    if len(buf) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if isinstance(buf, np.ndarray):
        flat = torch.from_numpy(buf)
    else:  # in-band buffer (only when pickled without buffer_callback)
        flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return flat.view(torch_dtype).reshape(shape)


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
                    is_param: bool) -> torch.Tensor:
    t = tensor_from_buffer(buf, dtype, shape)
    if is_param:
        return nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
        session = getattr(_current, "session", None)
        if session is not None:
            session.grad_tensors.append(t)
    return t


_INTERNAL = {("shardwise.rpc.serialization", "_rebuild_tensor"): _rebuild_tensor}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        internal = _INTERNAL.get((module, name))
        if internal is not None:
            return internal
        try:
            return resolve_global(module, name)
        except ForbiddenCallable as exc:
            raise pickle.UnpicklingError(str(exc)) from exc


def dumps(obj: Any, session: Session) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; returns the payload and the raw tensor buffers to send beside it."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    outer, _current.session = getattr(_current, "session", None), session
    try:
        _Pickler(out, session, buffers).dump(obj)
    finally:
        _current.session = outer
    return out.getvalue(), [b.raw() for b in buffers]


def loads(payload: bytes | bytearray, buffers: list[np.ndarray], session: Session) -> Any:
    """Unpickle a payload whose out-of-band buffers arrived as uint8 arrays."""
    outer, _current.session = getattr(_current, "session", None), session
    try:
        return _Unpickler(io.BytesIO(payload), buffers=buffers).load()
    finally:
        _current.session = outer


def register_internal(module: str, name: str, func: Any) -> None:
    """Let the unpickler resolve one of shardwise.rpc's own rebuild functions directly."""
    _INTERNAL[(module, name)] = func
