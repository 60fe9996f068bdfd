"""``fully_shard``: make a module an FSDP unit in place (the composable API, like torch's FSDP2).

Apply it bottom-up: first to each submodule that should be a unit of its own (e.g. every
transformer block), then to the root. Each call flattens and shards the parameters of the module
that no nested unit already owns (see [Note: flat parameters] in flat_param.py); the module
keeps its class, its names and its ``state_dict()`` keys.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardwise.fsdp import checks
from shardwise.fsdp.flat_param import FlatParamHandle
from shardwise.fsdp.mixed_precision import CPUOffload, MixedPrecision, resolve_dtypes
from shardwise.fsdp.policies import WrapPolicy, modules_to_wrap
from shardwise.fsdp.state_dict import register_state_dict_hooks
from shardwise.fsdp.unit import UNIT_ATTR, FSDPUnit, get_unit


def fully_shard(module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                reshard_after_forward: bool = True,
                mixed_precision: MixedPrecision | None = None,
                cpu_offload: CPUOffload | None = None,
                auto_wrap_policy: WrapPolicy | None = None,
                forward_prefetch: bool = False) -> nn.Module:
    """Shard ``module``'s parameters over ``process_group`` (default: the world group) and
    gather them around its forward and backward; returns ``module``.

    ``reshard_after_forward=False`` keeps the gathered parameters from forward until the end of
    backward (one all-gather per step instead of two, more memory). ``auto_wrap_policy`` first
    applies ``fully_shard`` (same options) to each submodule the policy picks.
    ``forward_prefetch=True`` (read on the root) issues the next unit's all-gather while the
    current unit computes its forward: faster where communication is slow, one unit more memory
    (see [Note: FSDP schedule]). Backward always prefetches.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard needs an nn.Module, got {type(module).__name__}")
    checks.check_not_wrapped(module, UNIT_ATTR)
    group = process_group or dist.group.WORLD
    if auto_wrap_policy is not None:
        for sub in modules_to_wrap(module, auto_wrap_policy):
            fully_shard(sub, process_group=group, reshard_after_forward=reshard_after_forward,
                        mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                        forward_prefetch=forward_prefetch)
    children = list(_child_units(module))
    params = _unit_params(module, children)
    handle = _make_handle(module, params, group, mixed_precision, cpu_offload)
    _cast_buffers(module, mixed_precision)
    unit = FSDPUnit(module, handle, group, reshard_after_forward, mixed_precision, children)
    unit.forward_prefetch = forward_prefetch
    setattr(module, UNIT_ATTR, unit)
    register_state_dict_hooks(unit)
    return module


def _child_units(module: nn.Module) -> Iterator[FSDPUnit]:
    for child in module.children():
        unit = get_unit(child)
        if unit is not None:
            yield unit
        else:
            yield from _child_units(child)


def _walk_unowned(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its submodules, skipping those that are (inside) nested units."""
    yield prefix, module
    for name, child in module.named_children():
        if get_unit(child) is None:
            yield from _walk_unowned(child, f"{prefix}{name}.")


def _unit_params(module: nn.Module, children: list[FSDPUnit]):
    """``[(param, [(owner module, attribute, relative name), ...]), ...]`` of this unit, each
    shared parameter once, with every place that holds it."""
    taken = {}
    for child in children:
        for unit in child.subtree():
            if unit.handle is not None:
                taken.update(unit.handle.live_orig_params())
    found: dict[int, tuple[nn.Parameter, list]] = {}
    for prefix, owner in _walk_unowned(module):
        for name, p in owner._parameters.items():
            if p is None:
                continue
            checks.check_not_shared_with_child(prefix + name, p, taken)
            found.setdefault(id(p), (p, []))[1].append((owner, name, prefix + name))
    return list(found.values())


def _make_handle(module: nn.Module, params, group, mp: MixedPrecision | None,
                 offload: CPUOffload | None) -> FlatParamHandle | None:
    if not params:
        return None
    named = [(holders[0][2], p) for p, holders in params]
    device = checks.check_same_device(module, named)
    dtype = checks.check_same_dtype(module, named)
    offload_params = bool(offload and offload.offload_params)
    checks.check_backend_device(dist.get_backend(group), device, offload_params)
    param_dtype, reduce_dtype = resolve_dtypes(mp, dtype)
    shard_device = torch.device("cpu") if offload_params else device
    return FlatParamHandle(params, group, param_dtype, reduce_dtype, device, shard_device)


def _cast_buffers(module: nn.Module, mp: MixedPrecision | None) -> None:
    if mp is None or mp.buffer_dtype is None:
        return
    for _, owner in _walk_unowned(module):
        for name, b in owner._buffers.items():
            if b is not None and b.is_floating_point():
                owner._buffers[name] = b.to(mp.buffer_dtype)
