"""``FullyShardedDataParallel.state_dict()`` / ``load_state_dict()`` by ``StateDictType``.

Every wrapper carries ``StateDictSettings`` (set by ``FSDP.state_dict_type`` /
``FSDP.set_state_dict_type``; default FULL_STATE_DICT). Keys are always the unwrapped module's
names (the wrapper's ``_fsdp_wrapped_module.`` segment removed).

- FULL_STATE_DICT: parameters gathered whole (one gather per unit; collective, every rank calls
  ``state_dict()``); ``offload_to_cpu`` moves them to CPU, ``rank0_only`` leaves other ranks an
  empty dict. Loading takes whole tensors (every rank copies its own rows, no collective).
- SHARDED_STATE_DICT: each parameter as its ``Shard(0)`` DTensor (no collective), what DCP
  saves; loading takes DTensors (shard to shard) or whole tensors.
- LOCAL_STATE_DICT: each unit's flat shard under ``<unit prefix>_flat_param`` as a ``Shard(0)``
  DTensor of ``world * shard_numel`` elements (torch FSDP1 gives a ShardedTensor here), plus the
  buffers; it loads only into the same wrapping at the same world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise._compat import DTensor, Shard
from shardwise.fsdp.fsdp1.config import StateDictSettings, StateDictType
from shardwise.fsdp.state_dict import _unit_prefixes, replace_with_full

FLAT = "_flat_param"


def transform_state_dict(inner: nn.Module, settings: StateDictSettings, state: dict,
                         prefix: str) -> None:
    """Turn the module's own state dict entries (DTensors, keys under ``prefix``) into the form
    ``settings`` asks for, in place."""
    kind, config = settings.state_dict_type, settings.state_dict_config
    if kind is StateDictType.FULL_STATE_DICT:
        replace_with_full(inner, state, prefix)
        if config.rank0_only and _rank(inner) != 0:
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
    elif kind is StateDictType.LOCAL_STATE_DICT:
        _to_local(inner, state, prefix)
    if config.offload_to_cpu:
        for key in [k for k in state if k.startswith(prefix)]:
            state[key] = _to_cpu(state[key])


def _rank(inner: nn.Module) -> int:
    prefixes = _unit_prefixes(inner)
    group = prefixes[0][1].group if prefixes else None
    return dist.get_rank(group)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, DTensor):
        local = value.to_local()
        if local.device.type == "cpu":
            return value
        return DTensor.from_local(local.cpu(), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _to_local(inner: nn.Module, state: dict, prefix: str) -> None:
    for unit_prefix, unit in _unit_prefixes(inner):
        handle = unit.handle
        if handle is None:
            continue
        for slot in handle.slots:
            for fqn in slot.fqns:
                state.pop(prefix + unit_prefix + fqn, None)
        flat = handle.flat_shard().clone()
        state[prefix + unit_prefix + FLAT] = DTensor.from_local(
            flat, handle.mesh, [Shard(0)], run_check=False,
            shape=torch.Size([handle.world * flat.numel()]), stride=(1,))


def load_local(inner: nn.Module, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Copy the ``_flat_param`` entries into the units' shards; return the rest (buffers) for
    the ordinary load. With ``strict`` a missing or unexpected flat entry raises KeyError."""
    rest = dict(state)
    missing = []
    for unit_prefix, unit in _unit_prefixes(inner):
        handle = unit.handle
        if handle is None:
            continue
        value = rest.pop(unit_prefix + FLAT, None)
        if value is None:
            missing.append(unit_prefix + FLAT)
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if tuple(local.shape) != (handle.layout.shard_numel,):
            raise ValueError(f"local state dict entry {unit_prefix + FLAT} has "
                             f"{tuple(local.shape)} elements, this rank's shard "
                             f"{(handle.layout.shard_numel,)}: a local state dict loads only "
                             "into the same wrapping at the same world size")
        handle.reshard()
        handle.load_flat_shard(local)
    extra = [k for k in rest if k.endswith(FLAT)]
    if strict and (missing or extra):
        raise KeyError(f"local state dict does not match the model: missing keys {missing}, "
                       f"unexpected keys {extra}")
    return rest


__all__ = ["FLAT", "load_local", "transform_state_dict"]
