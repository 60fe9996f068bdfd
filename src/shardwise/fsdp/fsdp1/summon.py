"""``summon_full_params``: every unit's parameters whole, as plain parameters, inside a block.

Entering gathers each unit's parameters in their own (full-precision) dtype, whatever the
mixed-precision setting (one gather per unit over its group: collective, every rank enters),
and puts an ``nn.Parameter`` holding the whole value at every place the sharded parameter was
(tied parameters stay tied). With ``with_grads`` the sharded gradients are gathered the same
way into the parameters' ``.grad``. Leaving with ``writeback`` copies each rank's own rows of
the (possibly modified) whole parameters back into its shard (no collective); then the sharded
``DTensor`` parameters return. A unit kept unsharded after a forward is resharded first (its
backward gathers again, as after any reshard).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise.fsdp.collectives import start_unit_gather
from shardwise.fsdp.flat_param import FlatParamHandle, ParamSlot, ShardState
from shardwise.fsdp.layout import local_tensor
from shardwise.fsdp.unit import FSDPUnit, TrainingState, get_unit, units_of


def summon_units(module: nn.Module, recurse: bool) -> list[FSDPUnit]:
    """The units ``summon_full_params(module, recurse)`` covers (with parameters)."""
    if recurse:
        units = units_of(module)
    else:
        inner = getattr(module, "_fsdp_wrapped_module", module)
        unit = get_unit(inner)
        units = [unit] if unit is not None else []
    if not units:
        raise ValueError(f"summon_full_params: {type(module).__name__} holds no FSDP unit")
    return [u for u in units if u.handle is not None]


@contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                       rank0_only: bool = False, offload_to_cpu: bool = False,
                       with_grads: bool = False) -> Iterator[None]:
    """See the module docstring. ``rank0_only``: only rank 0 sees whole parameters (the other
    ranks keep their shards); it cannot be combined with ``writeback``."""
    if rank0_only and writeback:
        raise ValueError("summon_full_params(rank0_only=True, writeback=True) is not supported: "
                         "parameters would differ in shape across ranks; pass writeback=False")
    units = summon_units(module, recurse)
    for unit in units:
        _check_idle(unit)
    swapped: list[tuple[FSDPUnit, list[nn.Parameter]]] = []
    try:
        for unit in units:
            handle = unit.handle
            handle.reshard()
            full = _gather(handle, [s.local.detach() for s in handle.slots])
            grads = _gather_grads(handle) if with_grads else None
            if rank0_only and handle.rank != 0:
                continue
            params = _install(handle, full, grads, offload_to_cpu)
            swapped.append((unit, params))
        yield
    finally:
        for unit, params in swapped:
            if writeback:
                _write_back(unit.handle, params)
            unit.handle.use_sharded_params()


def _check_idle(unit: FSDPUnit) -> None:
    root = unit.root_state
    if root is not None:
        root.end_abandoned_backward()  # [Note: a backward that raised] (root.py)
    if unit.state is TrainingState.FORWARD or (root is not None and root.callback_queued):
        raise RuntimeError("summon_full_params cannot be entered during a forward or backward "
                           "pass; call it between steps")
    handle = unit.handle
    for slot in handle.slots:
        for owner, name in slot.aliases:
            current = owner._parameters.get(name)
            if current is not slot.shard_param and handle.state is ShardState.SHARDED:
                raise RuntimeError("summon_full_params is already active for this unit "
                                   "(nested use on the same module is not supported)")


def _gather(handle: FlatParamHandle, locals_: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole tensors from each slot's local rows ``locals_`` (same layout as the shard):
    packed into a flat shard-shaped buffer and gathered over the unit's group."""
    src = torch.zeros(handle.layout.shard_numel, dtype=locals_[0].dtype,
                      device=locals_[0].device)
    for slot, local in zip(handle.slots, locals_):
        n = local.numel()
        src[slot.layout.shard_offset : slot.layout.shard_offset + n].copy_(local.reshape(-1))
    full = torch.empty(handle.layout.total, dtype=src.dtype, device=src.device)
    start_unit_gather(full, src, handle.layout, handle.rank, handle.global_ranks,
                      handle.group).wait()
    return [full[s.offset : s.offset + s.numel].view(s.shape) for s in handle.slots]


def _gather_grads(handle: FlatParamHandle) -> list[torch.Tensor | None]:
    """Whole gradients (None for parameters without one: the same on every rank, since every
    rank receives the reduced gradient of every parameter)."""
    grads = [s.shard_param.grad for s in handle.slots]
    if all(g is None for g in grads):
        return [None] * len(grads)
    locals_ = [local_tensor(g).detach() if g is not None else torch.zeros_like(s.local)
               for g, s in zip(grads, handle.slots)]
    full = _gather(handle, locals_)
    return [f if g is not None else None for f, g in zip(full, grads)]


def _install(handle: FlatParamHandle, full: list[torch.Tensor],
             grads: list[torch.Tensor | None] | None, offload: bool) -> list[nn.Parameter]:
    params = []
    for i, (slot, value) in enumerate(zip(handle.slots, full)):
        param = nn.Parameter(value.cpu() if offload else value,
                             requires_grad=slot.requires_grad)
        if grads is not None and grads[i] is not None:
            param.grad = grads[i].cpu() if offload else grads[i]
        for owner, name in slot.aliases:
            owner._parameters[name] = param
        params.append(param)
    return params


def _write_back(handle: FlatParamHandle, params: list[nn.Parameter]) -> None:
    """Each rank copies its rows of the whole parameter now held by the module (the one put
    there, or whatever the user assigned in its place) into its shard."""
    with torch.no_grad():
        for slot, param in zip(handle.slots, params):
            owner, name = slot.aliases[0]
            current = owner._parameters.get(name)
            value = current if current is not None else param
            _copy_rows(handle, slot, value)


def _copy_rows(handle: FlatParamHandle, slot: ParamSlot, value: torch.Tensor) -> None:
    if tuple(value.shape) != tuple(slot.shape):
        raise ValueError(f"summon_full_params: {slot.fqns[0]} was given shape "
                         f"{tuple(value.shape)} inside the block, it must keep "
                         f"{tuple(slot.shape)}")
    handle.load_full_param(slot, value)
