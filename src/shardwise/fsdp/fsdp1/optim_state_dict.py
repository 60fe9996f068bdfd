"""Optimizer state dicts of a sharded model keyed by parameter names, as torch's FSDP1 writes them.

An optimizer stepping a sharded model holds, per parameter, state shaped like the parameter:
``Shard(0)`` DTensors over this rank's rows (``zeros_like`` of a DTensor parameter is one), and
0-dim tensors such as Adam's ``step``. ``optim.state_dict()`` keys that state by position in the
optimizer's param groups; torch FSDP1's format keys it by fully qualified parameter name instead:
``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` (a tied
parameter appears once, under its first name).

- full (FULL_STATE_DICT): every DTensor value gathered whole (``full_tensor()``: one all-gather
  per tensor; collective, every rank calls it, in the optimizer's parameter order); with
  ``rank0_only`` other ranks get ``{}``; ``offload_to_cpu`` moves tensors to CPU.
- sharded (SHARDED_STATE_DICT): the DTensors as they are (no collective), what DCP saves.

Loading (``to_load``) turns either form back into what ``optim.load_state_dict`` takes for the
optimizer at hand: keys renumbered by its param groups, whole tensors cut to this rank's rows
as DTensors like their parameters (no collective), DTensors kept. A model without sharded
parameters (a plain model on one process) takes the whole tensors as they are, so a full state
saved at any world size loads into a plain optimizer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise._compat import DTensor, Shard
from shardwise.fsdp.fsdp1.config import OptimStateKeyType, as_enum


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> first name`` over ``model.named_parameters()`` (the wrapper reports the
    unwrapped module's names)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def optimizer_params(optim: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    return [list(group["params"]) for group in optim.param_groups]


def _names_of(model: nn.Module, groups: list[list[nn.Parameter]]) -> list[list[str]]:
    names = param_names(model)
    out = []
    for params in groups:
        missing = [tuple(p.shape) for p in params if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds parameters of shapes {missing} that are not "
                             "parameters of the model passed with it")
        out.append([names[id(p)] for p in params])
    return out


def to_named(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any] | None,
             full: bool, rank0_only: bool = False, cpu_offload: bool = True,
             group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """``optim``'s state dict (or ``osd``, numbered the same way) keyed by parameter name; full
    or sharded as described in the module docstring."""
    osd = optim.state_dict() if osd is None else osd
    groups = optimizer_params(optim)
    names = _names_of(model, groups)
    flat_names = [n for g in names for n in g]
    keep = not (full and rank0_only and dist.get_rank(group) != 0)
    state: dict[str, Any] = {}
    for index in sorted(k for k in osd["state"] if isinstance(k, int)):
        if index >= len(flat_names):
            raise ValueError(f"optimizer state has an entry for parameter {index}, the "
                             f"optimizer holds {len(flat_names)} parameters")
        entry = {}
        for key in sorted(osd["state"][index]):
            entry[key] = _export(osd["state"][index][key], full, cpu_offload)
        state[flat_names[index]] = entry
    if not keep:
        return {}
    param_groups = []
    for saved, group_names in zip(osd["param_groups"], names, strict=True):
        param_groups.append({**copy.deepcopy({k: v for k, v in saved.items() if k != "params"}),
                             "params": list(group_names)})
    return {"state": state, "param_groups": param_groups}


def _export(value: Any, full: bool, cpu_offload: bool) -> Any:
    if isinstance(value, DTensor) and full:
        value = value.full_tensor()
    if cpu_offload and isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            local = value.to_local()
            if local.device.type != "cpu":
                value = DTensor.from_local(local.cpu(), value.device_mesh, value.placements,
                                           run_check=False, shape=value.shape,
                                           stride=value.stride())
        else:
            value = value.cpu()
    return value


def to_load(model: nn.Module, optim: torch.optim.Optimizer,
            named: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed state dict (full or sharded) as ``optim.load_state_dict`` takes it for this
    model and optimizer (see the module docstring). The saved param groups must name the same
    parameters as the optimizer's, group by group."""
    if "param_groups" not in named or "state" not in named:
        raise ValueError("optimizer state dict must have 'state' and 'param_groups' (an empty "
                         "dict, e.g. from rank0_only on a rank other than 0, cannot be loaded)")
    groups = optimizer_params(optim)
    names = _names_of(model, groups)
    if len(named["param_groups"]) != len(groups):
        raise ValueError(f"optimizer state dict has {len(named['param_groups'])} param groups, "
                         f"the optimizer {len(groups)}")
    state, param_groups, index = {}, [], 0
    for saved, params, group_names in zip(named["param_groups"], groups, names):
        if list(saved["params"]) != group_names:
            raise ValueError(f"saved param group names {list(saved['params'])} do not match "
                             f"the optimizer's {group_names}")
        ids = []
        for p, name in zip(params, group_names):
            entry = named["state"].get(name)
            if entry is not None:
                state[index] = {k: _import(v, p, f"{name}.{k}") for k, v in entry.items()}
            ids.append(index)
            index += 1
        param_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                             "params": ids})
    return {"state": state, "param_groups": param_groups}


def _import(value: Any, param: nn.Parameter, what: str) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:  # e.g. Adam's step, which the optimizer increments in place
        return value.detach().clone()
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"optimizer state {what} has shape {tuple(value.shape)}, the parameter "
                         f"{tuple(param.shape)}")
    if not isinstance(param, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor):
        if value.placements == param.placements:
            return value
        value = value.full_tensor()
    return _rows_like(value, param)


def _rows_like(full: torch.Tensor, param: DTensor) -> DTensor:
    """This rank's rows of ``full`` as a DTensor placed like ``param`` (``Shard(0)`` on a 1D
    mesh: ``torch.chunk``'s split)."""
    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise NotImplementedError(f"loading optimizer state for a parameter placed as "
                                  f"{param.placements} on a {mesh.ndim}D mesh")
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-full.shape[0] // world)
    start = min(rank * chunk, full.shape[0])
    rows = full[start : start + chunk]
    local = param.to_local()
    return DTensor.from_local(rows.to(local.device, copy=True), mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def rekey(osd: dict[str, Any], key_type: Any, model: nn.Module,
          optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Re-key a state dict by parameter name (``PARAM_NAME``) or by position (``PARAM_ID``):
    positions are the optimizer's (or, without one, ``model.parameters()``'s) order."""
    kind = as_enum(key_type, OptimStateKeyType, "optim_state_key_type")
    params = ([p for g in optimizer_params(optim) for p in g] if optim is not None
              else list(model.parameters()))
    names = param_names(model)
    order = [names[id(p)] for p in params]
    if kind is OptimStateKeyType.PARAM_ID:
        mapping: dict[Any, Any] = {name: i for i, name in enumerate(order)}
    else:
        mapping = dict(enumerate(order))
    convert = (lambda k: mapping.get(k, k))  # noqa: E731 - already-converted keys pass
    return {"state": {convert(k): v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [convert(k) for k in g["params"]]}
                             for g in osd["param_groups"]]}
