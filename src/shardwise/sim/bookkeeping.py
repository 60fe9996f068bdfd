"""How much bookkeeping a rank keeps: the Python objects that a wrapped model and its optimizer
hold, measured after a dry run's step.

[Note: bookkeeping size]
A rank's *bookkeeping* is everything its wrappers keep besides model state: FSDP's units,
handles, layouts and DTensor specs, DDP's bucket plan, ZeRO's partition tables and part
lists, the meshes' rank tables, hooks and the optimizer's structure. ``bookkeeping_size``
measures it as the objects reachable from the given roots (the wrapped model and the
optimizer): each object's ``sys.getsizeof``, once, plus the bytes of every *real* tensor
reached. Model state is left out: in a dry run parameters, gradients and optimizer state are
fake tensors (no bytes, see [Note: simulated ranks]), counted by the library's byte
accounting instead; a real tensor in a dry run was made before the fake mode started, which
the library does only for bookkeeping (a mesh's rank table). The walk does not enter classes,
modules, code, a function's globals, weak references or the fake tensor mode (which caches
every fake tensor it made), so it sees what the wrappers hold, not the interpreter's or
torch's global state. The model's own objects (modules, parameters) are counted too; they do
not depend on the world size, so the growth of the total from one world size to another is
the growth of the library's per-rank bookkeeping.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from dataclasses import dataclass

import torch

from shardwise._compat import FakeTensorMode

_OPAQUE = (type, types.ModuleType, types.CodeType, types.FrameType, weakref.ref,
           weakref.ProxyType, weakref.CallableProxyType, FakeTensorMode, torch.device,
           torch.dtype)


@dataclass(frozen=True)
class Bookkeeping:
    """Objects reached from the roots and their bytes (``sys.getsizeof`` plus real tensors'
    bytes)."""

    objects: int
    bytes: int


def bookkeeping_size(*roots: object) -> Bookkeeping:
    """The bookkeeping reachable from ``roots``, each object counted once (see
    [Note: bookkeeping size])."""
    seen: set[int] = set()
    stack = list(roots)
    objects = size = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        objects += 1
        size += sys.getsizeof(obj) + _real_bytes(obj)
        stack.extend(_referents(obj))
    return Bookkeeping(objects, size)


def _real_bytes(obj: object) -> int:
    """A plain tensor's bytes unless it is fake or on the meta device (a subclass such as
    DTensor holds its data in an inner tensor, which is reached and counted on its own)."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type != "meta":
        return obj.untyped_storage().nbytes()
    return 0


def _referents(obj: object) -> list:
    """What ``obj`` holds, without a function's globals and code (a closure's cells, defaults
    and attributes only)."""
    if isinstance(obj, types.FunctionType):
        return [*(c.cell_contents for c in obj.__closure__ or () if _filled(c)),
                obj.__defaults__, obj.__kwdefaults__, obj.__dict__]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    return gc.get_referents(obj)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


__all__ = ["Bookkeeping", "bookkeeping_size"]
