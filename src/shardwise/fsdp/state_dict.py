"""State dicts of sharded modules: full (gathered, original names and shapes) and sharded.

``module.state_dict()`` on a sharded module returns the full state dict on every rank: a hook on
each unit's module all-gathers the unit's flat shard (one collective per unit, every rank must
call it) and puts each parameter back in its original shape under its original name, so the
result loads into the plain, unwrapped model. ``full_state_dict(model, rank0_only=True)`` keeps
the tensors only on rank 0. ``module.load_state_dict(full)`` copies each rank's part of every
parameter into its shard (no collective). ``sharded_state_dict`` / ``load_sharded_state_dict``
save and restore only this rank's shards (no collective), for per-rank checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.fsdp.unit import FSDPUnit, units_of

WRAPPED = "_fsdp_wrapped_module."  # the FullyShardedDataParallel wrapper's child name


def clean_name(name: str) -> str:
    """A name without the wrapper's ``_fsdp_wrapped_module.`` segments."""
    return name.replace(WRAPPED, "")


def register_state_dict_hooks(unit: FSDPUnit) -> None:
    unit.module.register_state_dict_post_hook(_full_params_hook(unit))
    unit.module.register_load_state_dict_pre_hook(_load_full_params_hook(unit))


def _full_params_hook(unit: FSDPUnit):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        handle = unit.handle
        if handle is None:
            return
        values = handle.gather_full_params()
        drop = unit.rank0_only_state_dict and dist.get_rank(unit.group) != 0
        for slot, value in zip(handle.slots, values):
            for fqn in slot.fqns:
                key = prefix + fqn
                if key in state_dict:
                    if drop:
                        del state_dict[key]
                    else:
                        state_dict[key] = value

    return hook


def _load_full_params_hook(unit: FSDPUnit):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any,
             strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        handle = unit.handle
        if handle is None:
            return
        handle.reshard()  # so that module attributes are the sharded parameters
        for slot in handle.slots:
            for fqn in slot.fqns:
                key = prefix + fqn
                value = state_dict.get(key)
                if value is None:
                    continue  # reported as missing by load_state_dict
                if tuple(value.shape) != tuple(slot.shape):
                    raise ValueError(f"state dict entry {clean_name(key)} has shape "
                                     f"{tuple(value.shape)}, the parameter has {tuple(slot.shape)}")
                lo = slot.local.param_offset
                state_dict[key] = value.detach().reshape(-1)[lo : lo + slot.local.length]

    return hook


@contextmanager
def _rank0_only(model: nn.Module, on: bool) -> Iterator[None]:
    units = units_of(model)
    for unit in units:
        unit.rank0_only_state_dict = on
    try:
        yield
    finally:
        for unit in units:
            unit.rank0_only_state_dict = False


def full_state_dict(model: nn.Module, rank0_only: bool = False,
                    cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict (original names and shapes). Collective: every rank
    calls it. With ``rank0_only`` other ranks get an empty dict. ``cpu`` moves tensors to CPU."""
    with _rank0_only(model, rank0_only):
        state = model.state_dict()
    if rank0_only and dist.get_rank(units_of(model)[0].group) != 0:
        return {}
    return {clean_name(k): (v.cpu() if cpu else v) for k, v in state.items()}


def expected_keys(model: nn.Module) -> list[str]:
    """The keys ``model.state_dict()`` has (parameters, persistent buffers), without gathering."""
    keys = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        keys += [dot + n for n, p in module._parameters.items() if p is not None]
        keys += [dot + n for n, b in module._buffers.items()
                 if b is not None and n not in module._non_persistent_buffers_set]
    return list(dict.fromkeys(clean_name(k) for k in keys))


def check_keys(model: nn.Module, state: dict[str, Any]) -> None:
    """Raise KeyError naming every missing and every unexpected key of a full state dict."""
    wanted = expected_keys(model)
    missing = [k for k in wanted if k not in state]
    extra = [k for k in state if k not in set(wanted)]
    if missing or extra:
        raise KeyError(f"full state dict does not match the model: missing keys {missing}, "
                       f"unexpected keys {extra}")


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (e.g. the plain model's) into a sharded model; every rank needs
    the full tensors. Missing or extra keys raise KeyError listing them."""
    check_keys(model, state)
    inner = getattr(model, "_fsdp_wrapped_module", model)
    inner.load_state_dict(state)


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's shards: ``{name: {"shard": 1D tensor, "offset": int, "shape": list}}`` for
    parameters (offset: where the shard starts in the flattened parameter) and buffers as they
    are. No collective."""
    state: dict[str, Any] = {}
    for prefix, unit in _unit_prefixes(model):
        if unit.handle is None:
            continue
        for slot in unit.handle.slots:
            entry = {"shard": slot.shard_param.detach().clone(),
                     "offset": slot.local.param_offset, "shape": list(slot.shape)}
            for fqn in slot.fqns:
                state[prefix + fqn] = entry
    for name, buf in model.named_buffers():
        state[clean_name(name)] = buf.detach().clone()
    return state


def load_sharded_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Restore this rank's shards saved by ``sharded_state_dict`` (same world size and units)."""
    seen = set()
    for prefix, unit in _unit_prefixes(model):
        if unit.handle is None:
            continue
        unit.handle.reshard()
        for slot in unit.handle.slots:
            for fqn in slot.fqns:
                key = prefix + fqn
                seen.add(key)
                entry = state.get(key)
                if entry is None:
                    raise KeyError(f"sharded state dict has no entry for parameter {key}")
                if entry["offset"] != slot.local.param_offset or list(entry["shape"]) != list(
                        slot.shape) or entry["shard"].numel() != slot.local.length:
                    raise ValueError(f"sharded state dict entry {key} was saved with another "
                                     "sharding (world size or wrapping differs)")
                with torch.no_grad():
                    slot.shard_param.copy_(entry["shard"])
    for name, buf in model.named_buffers():
        key = clean_name(name)
        if key in state:
            with torch.no_grad():
                buf.copy_(state[key])
        seen.add(key)
    extra = sorted(set(state) - seen)
    if extra:
        raise KeyError(f"sharded state dict has unexpected keys {extra}")


def _unit_prefixes(model: nn.Module) -> list[tuple[str, FSDPUnit]]:
    out = []
    for name, module in model.named_modules():
        unit = getattr(module, "_shardwise_fsdp_unit", None)
        if unit is not None:
            out.append((clean_name(f"{name}." if name else ""), unit))
    return out
