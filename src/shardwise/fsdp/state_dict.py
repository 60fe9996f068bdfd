"""State dicts of sharded modules: sharded (DTensors, as torch's FSDP2), full, and per rank.

``module.state_dict()`` on a module sharded by ``fully_shard`` holds each parameter as its
``Shard(0)`` DTensor (no collective), exactly what torch DCP's ``get_model_state_dict`` and
``dcp.save`` expect. ``full_state_dict(model)`` gathers every unit's parameters whole (one
gather per unit: every rank must call it) under their original names, so the result loads into
the plain, unwrapped model; ``rank0_only=True`` keeps the tensors on rank 0 only.
``FullyShardedDataParallel.state_dict()`` is the full one by default (torch FSDP1's
``FULL_STATE_DICT``). ``module.load_state_dict`` takes DTensors (copied shard to shard) or whole
tensors (each rank copies its own rows), no collective. ``sharded_state_dict`` /
``load_sharded_state_dict`` save and restore this rank's rows only, for per-rank checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise._compat import DTensor
from shardwise.fsdp import tp_params
from shardwise.fsdp.layout import sharded_dtensor, sharded_like
from shardwise.fsdp.unit import FSDPUnit, units_of

WRAPPED = "_fsdp_wrapped_module."  # the FullyShardedDataParallel wrapper's child name


def clean_name(name: str) -> str:
    """A name without the wrapper's ``_fsdp_wrapped_module.`` segments."""
    return name.replace(WRAPPED, "")


def register_state_dict_hooks(unit: FSDPUnit) -> None:
    """On each of the unit's modules, with the names that module holds ([Note: one unit over
    several modules], unit.py)."""
    for home, module in enumerate(unit.modules):
        module.register_state_dict_pre_hook(_end_abandoned_backward_hook(unit))
        module.register_load_state_dict_pre_hook(_load_params_hook(unit, home))
        module.register_load_state_dict_post_hook(_readopt_hook(unit))


def _end_abandoned_backward_hook(unit: FSDPUnit):
    """A state dict saved in the handler of a backward that raised holds the sharded
    parameters, not the ones that backward left gathered ([Note: a backward that raised],
    root.py)."""
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if unit.root_state is not None:
            unit.root_state.end_abandoned_backward()

    return hook


def _load_params_hook(unit: FSDPUnit, home: int):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any,
             strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        handle = unit.handle
        if handle is None:
            return
        handle.reshard()  # so that module attributes are the sharded parameters
        for slot in handle.slots:
            for fqn in slot.names_in(home):
                key = prefix + fqn
                value = state_dict.get(key)
                if value is None or isinstance(value, DTensor):
                    continue  # missing: reported by load_state_dict; DTensor: copied as is
                if tuple(value.shape) != tuple(slot.shape):
                    raise ValueError(f"state dict entry {clean_name(key)} has shape "
                                     f"{tuple(value.shape)}, the parameter has {tuple(slot.shape)}")
                start = slot.layout.row_start(handle.rank)
                rows = value.detach()[start : start + slot.layout.local_rows(handle.rank)]
                # a unit still on the meta device takes the rows where they are (an assigning
                # load then materialises it there: see _readopt_hook)
                device = value.device if slot.local.is_meta else slot.local.device
                state_dict[key] = sharded_dtensor(rows.to(device), slot.layout, handle.mesh)

    return hook


def _readopt_hook(unit: FSDPUnit):
    """After ``load_state_dict(assign=True)`` replaced parameters, put the unit's own parameters
    back, holding the assigned values: copied into the unit's flat shard, or, where the unit is
    still on the meta device (torch's meta-device init followed by an assigning load, the way
    torch's FSDP2 example resumes), adopted as its new flat shard on their device."""

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        handle = unit.handle
        if handle is None:
            return
        assigned = _assigned_locals(handle)
        if not assigned:
            return
        if handle.is_meta and len(unit.modules) > 1 and len(assigned) < len(handle.slots):
            return  # the unit's other modules load after this one: the last one adopts
        handle.use_sharded_params()
        if handle.is_meta:
            _adopt_assigned(unit, assigned)
            return
        with torch.no_grad():
            for index, local in assigned.items():
                handle.slots[index].local.copy_(local)

    return hook


def _assigned_locals(handle: Any) -> dict[int, torch.Tensor]:
    """``slot index -> this rank's rows`` of every parameter a load replaced (its own layout;
    ``requires_grad`` carried over to the unit's parameter)."""
    out = {}
    for index, slot in enumerate(handle.slots):
        for owner, name in slot.aliases:
            current = owner._parameters.get(name)
            if current is None or current is slot.shard_param:
                continue
            out[index] = _rows_of(current, slot, handle)
            slot.shard_param.requires_grad_(current.requires_grad)
            break
    return out


def _rows_of(value: torch.Tensor, slot: Any, handle: Any) -> torch.Tensor:
    """This rank's rows of an assigned parameter, laid out as the unit shards it."""
    if isinstance(value, DTensor):
        if (value.device_mesh != handle.mesh
                or tuple(value.placements) != tuple(slot.shard_param.placements)):
            value = value.full_tensor()  # collective over the value's mesh
        else:
            value = value.to_local()
    value = value.detach()
    if tuple(value.shape) == tuple(slot.shape) and tuple(slot.local.shape) != tuple(slot.shape):
        start = slot.layout.row_start(handle.rank)
        value = value[start : start + slot.layout.local_rows(handle.rank)]
    if tuple(value.shape) != tuple(slot.local.shape):
        raise ValueError(f"the value assigned to {slot.fqns[0]} has local shape "
                         f"{tuple(value.shape)}; this rank holds {tuple(slot.local.shape)}")
    return value


def _adopt_assigned(unit: FSDPUnit, assigned: dict[int, torch.Tensor]) -> None:
    """Make the assigned rows the unit's new flat shard, on their device and in their dtype."""
    handle = unit.handle
    left = [slot.fqns[0] for i, slot in enumerate(handle.slots) if i not in assigned]
    if left:
        raise RuntimeError(
            f"load_state_dict(assign=True) gave values to some parameters of the unit "
            f"{type(unit.module).__name__} but not to {left}, which are still on the meta "
            "device: a unit's parameters live in one flat buffer, so load all of them, or "
            "call module.to_empty(device=...) before loading")
    devices = {(t.device, t.dtype) for t in assigned.values()}
    if len(devices) > 1:
        raise RuntimeError(f"load_state_dict(assign=True) gave the parameters of the unit "
                           f"{type(unit.module).__name__} values on several devices or "
                           f"dtypes {sorted(map(str, devices))}; they share one flat buffer")
    for index, local in assigned.items():
        slot = handle.slots[index]
        # a DTensor's device is fixed when it is made: swap in one on the new device, keeping
        # the Parameter object (as nn.Module._apply does for DTensor parameters) and its spec
        # (1D, or 2D over torch's tensor parallelism)
        new = nn.Parameter(sharded_like(local, slot.shard_param),
                           requires_grad=slot.shard_param.requires_grad)
        torch.utils.swap_tensors(slot.shard_param, new)
    unit.adopt_applied_params()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every sharded parameter whole, by its name relative to ``model`` (without wrapper
    segments). Collective: one gather per unit, every rank calls it."""
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, list[torch.Tensor]] = {}  # one gather per unit, however many modules
    for prefix, unit, home in _unit_homes(model):
        if unit.handle is None:
            continue
        if id(unit) not in gathered:
            gathered[id(unit)] = unit.handle.gather_full_params()
        for slot, value in zip(unit.handle.slots, gathered[id(unit)]):
            value = tp_params.whole(slot.shard_param, value)  # FSDP x TP: across tp too
            for fqn in slot.names_in(home):
                out[prefix + fqn] = value
    return out


def replace_with_full(model: nn.Module, state: dict[str, Any], prefix: str = "") -> None:
    """Replace the DTensor entries of ``state`` (``model``'s state dict, keys under
    ``prefix``) by whole tensors, gathered (collective)."""
    for name, value in full_params(model).items():
        key = prefix + name
        if key in state:
            state[key] = value


def full_state_dict(model: nn.Module, rank0_only: bool = False,
                    cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict (original names and shapes). Collective: every rank
    calls it. With ``rank0_only`` other ranks get an empty dict. ``cpu`` moves tensors to CPU."""
    state = {clean_name(k): v for k, v in model.state_dict().items()}
    replace_with_full(model, state)
    if rank0_only and not _first_rank(model):
        return {}
    return {k: (v.cpu() if cpu else v) for k, v in state.items()}


def _first_rank(model: nn.Module) -> bool:
    """Whether this rank is rank 0 of the sharded model's groups (both, with hybrid sharding)."""
    handles = [u.handle for u in units_of(model) if u.handle is not None]
    if not handles:
        return True
    group, replicate = handles[0].group, handles[0].replicate_group
    return dist.get_rank(group) == 0 and (replicate is None or dist.get_rank(replicate) == 0)


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
    the full tensors. Missing or extra keys raise KeyError listing them. A model still on the
    meta device (built there and sharded, not yet ``to_empty``) is materialised on the
    tensors' device (an assigning load). No collective."""
    check_keys(model, state)
    inner = getattr(model, "_fsdp_wrapped_module", model)
    inner.load_state_dict(state, assign=on_meta(model))


def on_meta(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters or buffers is still on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's rows: ``{name: {"shard": tensor, "row_start": int, "shape": list}}`` for
    parameters (``row_start``: the first row of the whole parameter this rank owns) and
    buffers as they are. No collective."""
    state: dict[str, Any] = {}
    for prefix, unit, home in _unit_homes(model):
        if unit.handle is None:
            continue
        rank = unit.handle.rank
        for slot in unit.handle.slots:
            entry = {"shard": slot.local.detach().clone(),
                     "row_start": slot.layout.row_start(rank), "shape": list(slot.shape)}
            for fqn in slot.names_in(home):
                state[prefix + fqn] = entry
    for name, buf in model.named_buffers():
        state[clean_name(name)] = buf.detach().clone()
    return state


def load_sharded_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Restore this rank's rows saved by ``sharded_state_dict`` (same world size and units)."""
    seen = set()
    units: dict[int, tuple[FSDPUnit, dict[int, torch.Tensor]]] = {}  # a unit's rows, all modules
    for prefix, unit, home in _unit_homes(model):
        if unit.handle is None:
            continue
        unit.handle.reshard()
        rows = units.setdefault(id(unit), (unit, {}))[1]
        for index, slot in enumerate(unit.handle.slots):
            for fqn in slot.names_in(home):
                key = prefix + fqn
                seen.add(key)
                rows[index] = _checked_rows(key, state.get(key), slot, unit.handle.rank)
    for unit, rows in units.values():
        if unit.handle.is_meta:  # built on the meta device: these rows become the shard
            _adopt_assigned(unit, rows)
            continue
        with torch.no_grad():
            for index, value in rows.items():
                unit.handle.slots[index].local.copy_(value)
    for name, buf in list(model.named_buffers()):
        key = clean_name(name)
        if key in state:
            _load_buffer(model, name, buf, state[key])
        seen.add(key)
    extra = sorted(set(state) - seen)
    if extra:
        raise KeyError(f"sharded state dict has unexpected keys {extra}")


def _load_buffer(model: nn.Module, name: str, buf: torch.Tensor, value: torch.Tensor) -> None:
    if not buf.is_meta:
        with torch.no_grad():
            buf.copy_(value)
        return
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner._buffers[attr] = value.detach().clone().to(buf.dtype)


def _checked_rows(key: str, entry: dict | None, slot: Any, rank: int) -> torch.Tensor:
    if entry is None:
        raise KeyError(f"sharded state dict has no entry for parameter {key}")
    if (entry.get("row_start") != slot.layout.row_start(rank)
            or list(entry["shape"]) != list(slot.shape)
            or tuple(entry["shard"].shape) != tuple(slot.local.shape)):
        raise ValueError(f"sharded state dict entry {key} was saved with another sharding "
                         "(world size or wrapping differs)")
    return entry["shard"].detach()


def _unit_prefixes(model: nn.Module) -> list[tuple[str, FSDPUnit]]:
    """``(prefix of the unit's first module, unit)`` for each unit under ``model``."""
    return [(prefix, unit) for prefix, unit, home in _unit_homes(model) if home == 0]


def _unit_homes(model: nn.Module) -> list[tuple[str, FSDPUnit, int]]:
    """``(prefix, unit, home)`` for each module under ``model`` that carries a unit: a unit over
    several modules comes once per module, ``home`` being that module's index in
    ``unit.modules`` ([Note: one unit over several modules], unit.py)."""
    out = []
    for name, module in model.named_modules():
        unit = getattr(module, "_shardwise_fsdp_unit", None)
        if unit is not None:
            home = next(i for i, m in enumerate(unit.modules) if m is module)
            out.append((clean_name(f"{name}." if name else ""), unit, home))
    return out
