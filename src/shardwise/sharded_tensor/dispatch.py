"""The registry mapping torch functions to their sharded implementations.

``ShardedTensor.__torch_function__`` hands every torch call that sees a ShardedTensor to
``dispatch``; an op without a registered implementation raises ``UnsupportedShardedOp`` naming
the op and the sharding of each sharded argument, so no op ever runs silently on a local shard as
if it were the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_REGISTRY: dict[Callable, Callable] = {}


class UnsupportedShardedOp(NotImplementedError):
    """An op was called on a ShardedTensor (or with a sharding) it has no implementation for."""


def op_name(func: Callable) -> str:
    try:
        return torch.overrides.resolve_name(func) or repr(func)
    except Exception:  # noqa: BLE001 - naming must never fail
        return getattr(func, "__name__", repr(func))


def implements(*funcs: Callable) -> Callable[[Callable], Callable]:
    """Register ``impl(func, args, kwargs)`` for each of ``funcs``."""

    def deco(impl: Callable) -> Callable:
        for f in funcs:
            _REGISTRY[f] = impl
        return impl

    return deco


def describe_shardings(args: Any) -> str:
    from shardwise.sharded_tensor.sharded_tensor import ShardedTensor

    flat = _flatten(args)
    found = [f"{tuple(a.size())} {a.sharding_spec()!r}" for a in flat
             if isinstance(a, ShardedTensor)]
    return "; ".join(found) or "no ShardedTensor argument"


def unsupported(func: Callable, args: Any, why: str = "") -> UnsupportedShardedOp:
    msg = f"{op_name(func)} has no sharded implementation for {describe_shardings(args)}"
    return UnsupportedShardedOp(msg + (f": {why}" if why else ""))


def dispatch(func: Callable, args: tuple, kwargs: dict) -> Any:
    impl = _REGISTRY.get(func)
    if impl is None:
        raise unsupported(func, (args, kwargs),
                          "gather it first (full_tensor()) or reshard it to a supported spec")
    return impl(func, args, kwargs)


def _flatten(obj: Any) -> list:
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _flatten(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in _flatten(item)]
    return [obj]
