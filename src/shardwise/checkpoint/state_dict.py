"""``get_state_dict`` / ``set_state_dict``: any strategy's model and optimizer state as sharded
entries with global shapes and the original parameter names (torch DCP's names).

Model: the unwrapped module's ``state_dict()`` (DDP / ZeroDataParallel / FSDP wrappers removed,
FSDP's ``_fsdp_wrapped_module.`` segments dropped): plain tensors for replicated modules, Shard(0)
DTensors under ``fully_shard``, ShardedTensors under ``shard_module``. Entries share storage
with the model, so ``load`` into them restores the model in place.

Optimizer: ``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``,
keyed by parameter name so that it survives a change of strategy. State tensors are the
optimizer's own (loaded in place): plain tensors (replicated under DDP; under ZeRO present only
on the owning rank, so the owner writes them), DTensors under FSDP, and under tensor parallelism
the local shards wrapped as ShardedTensors with their parameter's layout. An optimizer that has
not stepped yet gets its state created first by one step with learning rate 0 and zero
gradients (parameters unchanged), as torch does; under ZeRO that step is collective.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardwise._compat import DTensor
from shardwise.checkpoint import exchange
from shardwise.ddp import DistributedDataParallel
from shardwise.fsdp.fsdp1.wrapper import FullyShardedDataParallel
from shardwise.fsdp.state_dict import clean_name
from shardwise.sharded_tensor import Shard, ShardedTensor, sharded_parameters
from shardwise.zero import ZeroDataParallel, ZeroRedundancyOptimizer

_WRAPPERS = (DistributedDataParallel, ZeroDataParallel, nn.parallel.DistributedDataParallel)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / ZeroDataParallel / FullyShardedDataParallel wrappers."""
    while True:
        if isinstance(model, _WRAPPERS):
            model = model.module
        elif isinstance(model, FullyShardedDataParallel):
            model = model._fsdp_wrapped_module
        else:
            return model


def get_model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The unwrapped model's state dict under original names (no collective)."""
    return {clean_name(k): v for k, v in unwrap(model).state_dict().items()}


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer
                   | Iterable[torch.optim.Optimizer], *, submodules: Any = None,
                   options: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optim_state_dict)``. Collective only when an optimizer must create
    its state under ZeRO (every rank calls it anyway)."""
    _no_options(submodules, options)
    opts = _as_list(optimizers)
    model_sd = get_model_state_dict(model)
    names = param_names(model)
    for opt in opts:
        ensure_state(opt)
    return model_sd, _merge([_optim_state(opt, names, model) for opt in opts])


def set_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer
                   | Iterable[torch.optim.Optimizer], *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: Any = None) -> Any:
    """Load ``model_state_dict`` into the model (strict: missing and unexpected keys are listed
    by ``load_state_dict``) and ``optim_state_dict`` into the optimizers; returns the model's
    ``load_state_dict`` result."""
    _no_options(None, options)
    result = unwrap(model).load_state_dict(model_state_dict, strict=True)
    names = param_names(model)
    offset = 0
    for opt in _as_list(optimizers):
        ensure_state(opt)
        offset = _load_optim(opt, names, optim_state_dict, offset)
    return result


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its original name (as the optimizer sees the parameter)."""
    return {id(p): clean_name(n) for n, p in unwrap(model).named_parameters()}


def ensure_state(opt: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has none and no gradients yet (a new one, before a
    load), as torch's ``get_state_dict`` does: one step with learning rate 0 and zero gradients
    (parameters unchanged). An optimizer that holds any state, or any gradient, is left as it
    is: stepping it again would advance its moments and step counts, so saving would change the
    run; a parameter that never got a gradient keeps no state, as in a run that never saved, and
    its state is created at its first step. Under ZeRO the ranks agree (one all-reduce): any
    rank's state or gradients count."""
    group = opt.process_group if isinstance(opt, ZeroRedundancyOptimizer) else None
    local = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    params = [p for g in opt.param_groups for p in g["params"]]
    started = bool(local.state) or any(p.grad is not None for p in params)
    if group is not None:
        started = exchange.any_true(started, group)
    if started:
        return
    made = [p for p in params if p.requires_grad]
    for p in made:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for p in made:
            p.grad = None


def _check_whole_parameter_state(opt) -> None:
    """ZeRO's element partition keeps state per slice of a parameter, which these state dicts
    (one entry per parameter) cannot hold: refused rather than saved or loaded empty."""
    if isinstance(opt, ZeroRedundancyOptimizer) and opt.partition == "elements":
        raise ValueError("a ZeroRedundancyOptimizer(partition='elements') keeps each "
                         "parameter's state in slices across ranks: save it with "
                         "consolidate_state_dict(to) and state_dict(), load it with "
                         "load_state_dict()")


def _optim_state(opt, names: dict[int, str], model: nn.Module) -> dict[str, Any]:
    _check_whole_parameter_state(opt)
    tp = _tp_params(model)
    state: dict[str, Any] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            entry = opt.state.get(p)
            if entry:
                fqn = _name(names, p)
                state[fqn] = {k: _sharded_like(v, tp.get(id(p))) for k, v in entry.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [_name(names, p) for p in g["params"]]} for g in opt.param_groups]
    return {"state": state, "param_groups": groups}


def _sharded_like(value: Any, st: ShardedTensor | None) -> Any:
    """An optimizer state tensor of a tensor-parallel parameter, as a ShardedTensor laid out
    like the parameter (same storage); anything else as it is."""
    if st is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    local = st.local_shards()[0]
    if tuple(value.shape) != tuple(local.tensor.shape) or value.dim() == 0:
        return value
    meta = st.metadata()
    if value.dtype != meta.tensor_properties.dtype:
        return value
    return ShardedTensor._from_parts([Shard(value, local.metadata)], meta, st.sharding_spec(),
                                     st.process_group)


def _tp_params(model: nn.Module) -> dict[int, ShardedTensor]:
    """id(local shard Parameter) -> its ShardedTensor, for parameters sharded by shard_module."""
    out = {}
    for module in unwrap(model).modules():
        for name, st in sharded_parameters(module).items():
            p = module._parameters.get(name)
            if p is not None and not isinstance(p, DTensor):  # DTensor: FSDP x TP presents it
                out[id(p)] = st
    return out


def _load_optim(opt, names: dict[int, str], saved: dict[str, Any], offset: int) -> int:
    _check_whole_parameter_state(opt)
    groups = saved["param_groups"][offset : offset + len(opt.param_groups)]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"optim_state_dict has {len(saved['param_groups'])} param groups; the "
                         f"optimizers need at least {offset + len(opt.param_groups)}")
    for n, (g, sg) in enumerate(zip(opt.param_groups, groups)):
        mine = [_name(names, p) for p in g["params"]]
        if mine != list(sg["params"]):
            raise ValueError(f"param group {offset + n}: the optimizer holds {mine}, the state "
                             f"dict's group holds {list(sg['params'])}")
        for k, v in sg.items():
            if k != "params":
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
    known = {_name(names, p) for g in opt.param_groups for p in g["params"]}
    saved_params = {n for sg in groups for n in sg["params"]}
    unexpected = sorted(set(saved["state"]) - _all_names(saved, known))
    if unexpected:
        raise KeyError(f"optim_state_dict has state for unknown parameters {unexpected}")
    for g in opt.param_groups:
        for p in g["params"]:
            target = opt.state.get(p)
            entry = saved["state"].get(_name(names, p))
            if target and entry:
                _copy_entry(_name(names, p), target, entry)
            elif target and _name(names, p) in saved_params:
                # it had no state when saved (it never got a gradient): it gets its state at
                # its first step, as in the run that saved
                del opt.state[p]
    return offset + len(opt.param_groups)


def _all_names(saved: dict, known: set[str]) -> set[str]:
    return known | {n for g in saved["param_groups"] for n in g["params"]}


def _copy_entry(fqn: str, target: dict, entry: dict) -> None:
    with torch.no_grad():
        for k, v in entry.items():
            have = target.get(k)
            if isinstance(have, torch.Tensor) and isinstance(v, (torch.Tensor, ShardedTensor)):
                _copy_tensor(f"{fqn}.{k}", have, v)
            else:
                target[k] = v


def _copy_tensor(name: str, dst: torch.Tensor, src: Any) -> None:
    d = dst._local_tensor if isinstance(dst, DTensor) else dst
    if isinstance(src, ShardedTensor):
        s = src.local_shards()[0].tensor
    elif isinstance(src, DTensor):
        if isinstance(dst, DTensor) and src.placements != dst.placements:
            raise ValueError(f"optimizer state {name}: placements {src.placements} differ from "
                             f"the optimizer's {dst.placements}; load the checkpoint into the "
                             "state dict get_state_dict returns instead")
        s = src._local_tensor
    elif isinstance(dst, DTensor) and tuple(src.shape) == tuple(dst.shape):
        s = src[_local_region(dst)]  # a whole tensor: this rank's box of it
    else:
        s = src
    if s.data_ptr() != d.data_ptr():
        d.copy_(s)


def _local_region(dt: DTensor) -> tuple[slice, ...]:
    from shardwise.checkpoint.boxes import local_chunks

    chunk = local_chunks("", dt)[0]
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.tensor.shape))


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len(parts) == 1:
        return parts[0]
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        state.update(part["state"])
        groups += part["param_groups"]
    return {"state": state, "param_groups": groups}


def _name(names: dict[int, str], p: torch.Tensor) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the model's "
                         f"(shape {tuple(p.shape)})") from None


def _as_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _no_options(submodules: Any, options: Any) -> None:
    if submodules is not None or options is not None:
        warnings.warn("shardwise.checkpoint: submodules= and options= (torch's "
                      "StateDictOptions) are not supported and are ignored", stacklevel=3)
