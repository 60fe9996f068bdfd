"""Which instances a pickle may set state on, and how deep its data may nest.

[Note: data classes] The scan (pickle_scan.py) makes sure a ``BUILD`` targets an instance the
same pickle made with ``NEWOBJ`` / ``NEWOBJ_EX`` / ``REDUCE`` of a named class, once, with a
plain state;
:func:`check_builds` then decides on the class, resolved exactly as the unpickler will:

* it is a class whose ``__new__`` is ``object.__new__`` (so ``NEWOBJ`` gives a fresh object)
  and, for ``REDUCE``, whose metaclass calls it as ``type`` does (so no existing object, such
  as an enum member, comes back);
* it is data: a new ``OrderedDict`` (a ``state_dict``'s ``_metadata``), an ``nn.Module``
  subclass, or a class the worker allows by name (registered, or defined in an allowed module
  or the script); never an optimizer, and never a class the unpickler's data globals return
  (``torch.device``, ``complex``, ``slice``, ...);
* its state is applied by code that only stores data: Python's default (the state dict goes
  into ``__dict__``, slots by ``setattr``), ``nn.Module.__setstate__`` or a ``torch.nn``
  module's override of it, or the class's own ``__setstate__`` when the class itself was
  passed to ``register`` (its author vouched for it). Any other ``__setstate__`` (a library
  base class that reopens a file, a program class's own) is refused with its name.

Values inside a state are unpickled like any other: a function in a hooks dict goes through the
allow-list. :func:`check_depth` bounds nesting ([Note: pickle scan]).
"""

from __future__ import annotations

import gc
import itertools
import pickle
import types
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from shardwise.rpc.trust.callables import is_registered, resolve_data
from shardwise.rpc.trust.pickle_scan import UnsafePickle

MAX_DEPTH = 256  # levels of containers and objects in one message


class PickleTooDeep(pickle.UnpicklingError):
    """A message's data nests deeper than :data:`MAX_DEPTH` levels."""


def check_builds(builds: list[tuple[tuple[str, str], str]],
                 resolve: Callable[[str, str], Any]) -> None:
    """Refuse a ``BUILD`` whose instance's class is not a data class ([Note: data classes]);
    ``resolve`` is the unpickler's ``find_class``."""
    for name, how in builds:
        cls = resolve(*name)
        problem = _problem(cls, how)
        if problem:
            raise UnsafePickle(f"pickle sets the state of a {'.'.join(name)} instance: refused, "
                               f"{problem}")


def _problem(cls: Any, how: str) -> str | None:
    if cls is _FRESH_ORDERED_DICT:
        return None  # a new OrderedDict; its state is its __dict__ (a state_dict's _metadata)
    if not isinstance(cls, type):
        return "it is not a class (RPC sets state only on instances of data classes)"
    if cls.__new__ is not object.__new__:
        return "its class has its own __new__, so the instance may not be a fresh one"
    if how == "call" and type(cls).__call__ is not type.__call__:
        return "its metaclass decides what calling the class returns"
    if issubclass(cls, torch.optim.Optimizer) or not (
            issubclass(cls, nn.Module) or cls.__module__ not in _LIBRARY_MODULES):
        return "it is not a data class"
    owner = next((k for k in cls.__mro__ if "__setstate__" in vars(k)), None)
    if owner is None or owner is nn.Module or owner is cls and is_registered(cls) or (
            issubclass(owner, nn.Module) and owner.__module__.startswith("torch.nn.modules.")):
        return None
    return (f"its __setstate__ is {owner.__module__}.{owner.__qualname__}'s; RPC runs only "
            "nn.Module's own (or torch.nn's) and that of a class registered with "
            "shardwise.rpc.register")


_LIBRARY_MODULES = frozenset({"builtins", "torch", "collections"})
_FRESH_ORDERED_DICT = resolve_data("collections", "OrderedDict")


# ---------------------------------------------------------------------------- nesting depth
_LEAF_TYPES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor,
               np.ndarray, np.generic, type, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, types.ModuleType, torch.dtype, torch.device, torch.layout,
               memoryview, pickle.PickleBuffer)


def _children(obj: Any) -> Iterable[Any] | None:
    """What ``obj`` holds, or None for a leaf."""
    kind = type(obj)
    if kind in (list, tuple, set, frozenset, torch.Size):
        return obj
    if isinstance(obj, dict):
        return itertools.chain.from_iterable(obj.items())
    if kind is slice:
        return (obj.start, obj.stop, obj.step)
    if isinstance(obj, _LEAF_TYPES):
        return None
    if isinstance(obj, nn.Module):
        return vars(obj).values()
    module = getattr(kind, "__module__", "") or ""
    if module.startswith(("torch", "shardwise", "numpy", "builtins")):
        return None  # library objects (RRefs, ...) hold the worker's state, not the message's
    return [x for x in gc.get_referents(obj) if x is not kind]


def check_depth(root: Any, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`PickleTooDeep` if containers and objects nest deeper than ``limit``
    (iteratively: deep data never recurses here; shared parts are measured once)."""
    kids = _children(root)
    if kids is None:
        return
    done: dict[int, int] = {}  # id -> height of what is below (objects stay alive in root)
    active = {id(root)}
    path: list[tuple[Any, Any, list[int]]] = [(root, iter(kids), [0])]
    while path:
        node, it, best = path[-1]
        for child in it:
            below = _children(child)
            if below is None:
                continue
            height = done.get(id(child))
            if height is not None:
                if len(path) + height > limit:
                    _too_deep(limit)
                best[0] = max(best[0], height)
                continue
            if id(child) in active:
                continue  # a cycle: no deeper than what it closes
            if len(path) >= limit:
                _too_deep(limit)
            active.add(id(child))
            path.append((child, iter(below), [0]))
            break
        else:
            path.pop()
            active.discard(id(node))
            done[id(node)] = best[0] + 1
            if path:
                parent = path[-1][2]
                parent[0] = max(parent[0], best[0] + 1)


def _too_deep(limit: int) -> None:
    raise PickleTooDeep(f"RPC message data nests deeper than {limit} levels of containers "
                        "and objects")
