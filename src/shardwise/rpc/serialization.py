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

from shardwise.rpc import pickle_scan
from shardwise.rpc.callables import ForbiddenCallable, register, resolve_data, resolve_global


class SerializationHooks(Protocol):
    """What the agent supplies for objects that need it (see agent.py)."""

    def reduce_rref(self, rref: Any, dest: int) -> tuple: ...
    def reduce_cuda_tensor(self, tensor: torch.Tensor, dest: int) -> tuple: ...


@dataclass
class Session:
    """State of one pickling or unpickling pass (one message)."""

    hooks: SerializationHooks | None
    peer: int  # destination when pickling, source when unpickling
    grad_tensors: list[torch.Tensor] = field(default_factory=list)  # requiring grad, in order
    pending: list[Any] = field(default_factory=list)  # futures to wait for before sending


class _ThreadState(threading.local):
    session: Session | None = None  # (a class default: no AttributeError to catch per call)


_current = _ThreadState()


def current_session() -> Session:
    session = _current.session
    if session is None:
        raise RuntimeError("shardwise.rpc object (un)pickled outside an RPC message")
    return session


def _reduce_tensor_hook(t: torch.Tensor) -> Any:
    """The pickler's reducer for exact ``Tensor`` / ``Parameter`` (its ``dispatch_table``)."""
    session = current_session()
    reduced = _reduce_tensor(t, session)
    return t.__reduce_ex__(5) if reduced is NotImplemented else reduced


class _Pickler(pickle.Pickler):
    # [Note: fast pickling] A per-type table is looked up in C, so only tensors call back into
    # Python; a ``reducer_override`` would be called for every object of the message. RRefs
    # reduce themselves (``RRef.__reduce__``) through the current session.
    dispatch_table = {torch.Tensor: _reduce_tensor_hook, nn.Parameter: _reduce_tensor_hook}


def _reduce_tensor(t: torch.Tensor, session: Session) -> Any:
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented  # torch's own (in-band) pickling
    if t.requires_grad:
        session.grad_tensors.append(t)
    if t.is_cpu:
        return _rebuild_tensor, (*cpu_buffer(t), t.requires_grad, type(t) is nn.Parameter)
    if t.device.type == "cuda":
        if session.hooks is None:
            raise RuntimeError("cannot send a CUDA tensor outside an RPC agent")
        return session.hooks.reduce_cuda_tensor(t, session.peer)
    raise RuntimeError(f"RPC cannot send tensors on device {t.device}")


def cpu_buffer(t: torch.Tensor) -> tuple[pickle.PickleBuffer, str, tuple[int, ...]]:
    """A zero-copy byte view of a CPU tensor (contiguous first if it is not), dtype, shape."""
    data = t.detach() if t.requires_grad else t
    if data.is_conj() or data.is_neg():
        data = data.resolve_conj().resolve_neg()
    if not data.is_contiguous():
        data = data.contiguous()
    name = _DTYPE_NAMES.get(data.dtype) or str(data.dtype).removeprefix("torch.")
    # numpy() is the fast way to the bytes; bfloat16 and friends (no numpy dtype) go as raw bytes
    arr = data.numpy() if name in _NUMPY_DTYPES else data.reshape(-1).view(torch.uint8).numpy()
    return pickle.PickleBuffer(arr), name, tuple(data.shape)


def tensor_from_buffer(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor as a view of a received buffer (no copy). The shape must fit the
    buffer's bytes exactly: a peer cannot make this worker allocate memory it did not send."""
    torch_dtype = _torch_dtype(dtype)
    _check_shape(shape, len(buf), torch_dtype)
    if len(buf) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if not isinstance(buf, np.ndarray):  # in-band buffer (only when pickled without callback)
        buf = np.frombuffer(bytearray(buf), dtype=np.uint8)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is not None:
        arr = buf.view(np_dtype)
        if arr.flags.aligned:
            return torch.from_numpy(arr.reshape(shape))
    return torch.from_numpy(buf).view(torch_dtype).reshape(shape)


def _check_shape(shape: Any, nbytes: int, dtype: torch.dtype) -> None:
    if not isinstance(shape, tuple) or len(shape) > 64 \
            or not all(type(d) is int and d >= 0 for d in shape):
        raise pickle.UnpicklingError(f"bad tensor shape {shape!r:.80}")
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != nbytes:
        raise pickle.UnpicklingError(f"tensor of shape {shape} and dtype {dtype} does not fit "
                                     f"its {nbytes}-byte buffer")


def _torch_dtype(name: str) -> torch.dtype:
    torch_dtype = _DTYPES.get(name)
    if torch_dtype is None:
        torch_dtype = vars(torch).get(name) if isinstance(name, str) else None
        if not isinstance(torch_dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unknown tensor dtype {name!r}")
        _DTYPES[name] = torch_dtype
    return torch_dtype


_NUMPY_DTYPES = {name: np.dtype(name) for name in (
    "float16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32",
    "int64", "uint8", "bool")}
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in _NUMPY_DTYPES}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@register
def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
                    is_param: bool) -> torch.Tensor:
    t = tensor_from_buffer(buf, dtype, shape)
    if is_param:
        return nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
        session = _current.session
        if session is not None:
            session.grad_tensors.append(t)
    return t


class _Unpickler(pickle.Unpickler):
    """Resolves globals only through the allow-list ([Note: allow-list] in callables.py)."""

    def find_class(self, module: str, name: str) -> Any:
        data = resolve_data(module, name)
        if data is not None:
            return data
        try:
            return resolve_global(module, name)
        except ForbiddenCallable as exc:
            raise pickle.UnpicklingError(str(exc)) from exc


def dumps(obj: Any, session: Session) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; returns the payload and the raw tensor buffers to send beside it."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    outer, _current.session = _current.session, session
    try:
        _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    finally:
        _current.session = outer
    return out.getvalue(), [b.raw() for b in buffers]


def loads(payload: bytes | bytearray, buffers: list[np.ndarray], session: Session) -> Any:
    """Unpickle a payload whose out-of-band buffers arrived as uint8 arrays."""
    pickle_scan.check(payload)  # [Note: pickle scan]
    outer, _current.session = _current.session, session
    try:
        return _Unpickler(io.BytesIO(payload), buffers=buffers).load()
    finally:
        _current.session = outer
