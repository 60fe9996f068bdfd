"""Payload and tensor buffers: pickle protocol 5 with tensors carried out of band.

A message becomes one pickle payload plus one raw buffer per distinct tensor. A CPU tensor's
bytes are never copied on the way out: the pickler hands the transport a memoryview of the
tensor's own memory (a non-contiguous tensor is made contiguous first, the one copy that cannot
be avoided) and the transport passes those views to ``sendmsg``. On the way in the transport
receives each buffer straight into a fresh uninitialised tensor, and the payload's tensors are
rebuilt as views of those tensors, again without a copy. numpy arrays of numeric and bool
dtypes travel the same way (``_rebuild_ndarray``); numpy's own pickling (``_reconstruct``,
``_frombuffer``) is never resolved.

What a received pickle may do is checked before the C unpickler runs it ([Note: pickle scan]
in pickle_scan.py, [Note: data classes] in pickle_rules.py): globals only through the
allow-list, ``BUILD`` only on fresh instances of data classes, bounded nesting.

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

from shardwise.rpc.trust import pickle_rules, pickle_scan
from shardwise.rpc.trust.callables import (
    ForbiddenCallable,
    register,
    resolve_data,
    resolve_data_class,
    resolve_global,
)


class SerializationHooks(Protocol):
    """What the agent supplies for objects that need it (see rpc/agent.py)."""

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
    dispatch_table: dict[type, Any] = {torch.Tensor: _reduce_tensor_hook,
                                       nn.Parameter: _reduce_tensor_hook}


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
    buf = _received_bytes(buf)
    _check_shape(shape, len(buf), torch_dtype.itemsize, "tensor")
    if len(buf) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is not None:
        arr = buf.view(np_dtype)
        if arr.flags.aligned:
            return torch.from_numpy(arr.reshape(shape))
    return torch.from_numpy(buf).view(torch_dtype).reshape(shape)


class BadTensorData(pickle.UnpicklingError):
    """A received tensor or array whose dtype, shape or bytes do not describe dense data."""


_MAX_DIM = 1 << 62


def _check_shape(shape: Any, nbytes: int, itemsize: int, what: str) -> None:
    """``shape`` is a tuple of at most 64 non-negative ints whose product (at most 2**62, also
    for an empty tensor) times ``itemsize`` is exactly ``nbytes``."""
    if type(shape) is not tuple or len(shape) > 64 \
            or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape):
        raise BadTensorData(f"bad {what} shape {shape!r:.80}: a tuple of at most 64 "
                            f"non-negative ints")
    numel = nonzero = 1
    for d in shape:
        numel *= d
        nonzero *= d or 1
    if nonzero > _MAX_DIM or numel * itemsize != nbytes:
        raise BadTensorData(f"{what} of shape {shape} and {itemsize}-byte elements does not "
                            f"fit its {nbytes}-byte buffer")


def _received_bytes(buf: Any) -> np.ndarray:
    """A received buffer as a flat uint8 array: the transport's out-of-band array itself, or a
    copy of in-band bytes (only when a payload was pickled without a buffer callback)."""
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise BadTensorData("a tensor's buffer must be flat bytes")
        return buf
    if isinstance(buf, (bytes, bytearray, memoryview, pickle.PickleBuffer)):
        return np.frombuffer(bytearray(buf), dtype=np.uint8)
    raise BadTensorData(f"a tensor's buffer must be bytes, not {type(buf).__name__}")


def _torch_dtype(name: Any) -> torch.dtype:
    torch_dtype = _DTYPES.get(name) if type(name) is str else None
    if torch_dtype is None:
        raise BadTensorData(f"RPC does not rebuild tensors of dtype {name!r:.40} (dense "
                            f"dtypes only: {', '.join(_DTYPES)})")
    return torch_dtype


_NUMPY_DTYPES = {name: np.dtype(name) for name in (
    "float16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32",
    "int64", "uint8", "uint16", "uint32", "uint64", "bool")}
# dense, non-quantized dtypes whose bytes are their values (what the sender's cpu_buffer sends)
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in (
    *_NUMPY_DTYPES, "bfloat16", "complex32", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu") if isinstance(getattr(torch, name, None), torch.dtype)}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@register
def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
                    is_param: bool) -> torch.Tensor:
    if type(requires_grad) is not bool or type(is_param) is not bool:
        raise BadTensorData("a tensor's requires_grad and is_param must be bools")
    t = tensor_from_buffer(buf, dtype, shape)
    if requires_grad and not (t.is_floating_point() or t.is_complex()):
        raise BadTensorData(f"a tensor of dtype {t.dtype} cannot require grad")
    if is_param:
        return nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
        session = _current.session
        if session is not None:
            session.grad_tensors.append(t)
    return t


# ---------------------------------------------------------------------------- numpy arrays
def _reduce_ndarray(a: np.ndarray) -> tuple:
    """An ndarray as ``_rebuild_ndarray(bytes, dtype name, shape)``, its bytes out of band."""
    name = a.dtype.name if a.dtype.isnative else a.dtype.newbyteorder("=").name
    if name not in _NUMPY_DTYPES or a.dtype.fields is not None:
        raise TypeError(f"RPC sends numpy arrays of numeric and bool dtypes only, not "
                        f"{a.dtype!r} (object, string and structured arrays are not data a "
                        "peer may rebuild)")
    data = np.ascontiguousarray(a, dtype=_NUMPY_DTYPES[name])
    flat = data.reshape(-1).view(np.uint8) if data.size else np.empty(0, np.uint8)
    return _rebuild_ndarray, (pickle.PickleBuffer(flat), name, tuple(a.shape))


def _reduce_np_scalar(x: np.generic) -> tuple:
    return _rebuild_np_scalar, (x.dtype.name, x.tobytes())


@register
def _rebuild_ndarray(buf: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The receiving side of :func:`_reduce_ndarray`: a view of the received bytes (a copy if
    they are not aligned for the dtype); numeric and bool dtypes only."""
    np_dtype = _NUMPY_DTYPES.get(dtype) if type(dtype) is str else None
    if np_dtype is None:
        raise BadTensorData(f"RPC does not rebuild numpy arrays of dtype {dtype!r:.40} "
                            f"(numeric and bool only: {', '.join(_NUMPY_DTYPES)})")
    buf = _received_bytes(buf)
    _check_shape(shape, len(buf), np_dtype.itemsize, "numpy array")
    if len(buf) == 0:
        return np.empty(shape, dtype=np_dtype)
    arr = buf.view(np_dtype) if buf.ctypes.data % np_dtype.alignment == 0 \
        else np.frombuffer(bytearray(buf), dtype=np_dtype)
    return arr.reshape(shape)


@register
def _rebuild_np_scalar(dtype: str, data: Any) -> np.generic:
    np_dtype = _NUMPY_DTYPES.get(dtype) if type(dtype) is str else None
    if np_dtype is None or type(data) is not bytes or len(data) != np_dtype.itemsize:
        raise BadTensorData(f"bad numpy scalar of dtype {dtype!r:.40}")
    return np.frombuffer(data, dtype=np_dtype)[0]


_Pickler.dispatch_table[np.ndarray] = _reduce_ndarray
for _dtype in _NUMPY_DTYPES.values():
    _Pickler.dispatch_table[_dtype.type] = _reduce_np_scalar


# ---------------------------------------------------------------------------- unpickling
class _Unpickler(pickle.Unpickler):
    """Resolves globals only through the allow-list ([Note: allow-list] in callables.py); a
    data-only class (an imported ``nn.Module`` subclass) only where the scan saw it used as a
    ``NEWOBJ`` class and nothing else ([Note: pickle scan] in pickle_scan.py)."""

    new_only: frozenset[tuple[str, str]] = frozenset()  # set per message when not empty

    def find_class(self, module: str, name: str) -> Any:
        return _find_class(module, name, self.new_only)


def _find_class(module: str, name: str, new_only: frozenset[tuple[str, str]]) -> Any:
    data = resolve_data(module, name)
    if data is not None:
        return data
    try:
        return resolve_global(module, name)
    except ForbiddenCallable as exc:
        if (module, name) in new_only:
            cls = resolve_data_class(module, name)
            if cls is not None:
                return cls
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
    scan = pickle_scan.check(payload)  # [Note: pickle scan]
    if scan.builds:
        pickle_rules.check_builds(scan.builds,
                                  lambda m, n: _find_class(m, n, scan.new_only))
    outer, _current.session = _current.session, session
    try:
        unpickler = _Unpickler(io.BytesIO(payload), buffers=buffers)
        if scan.new_only:
            unpickler.new_only = scan.new_only
        value = unpickler.load()
    finally:
        _current.session = outer
    if scan.containers > pickle_rules.MAX_DEPTH:
        pickle_rules.check_depth(value)
    return value
