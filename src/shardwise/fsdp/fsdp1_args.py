"""The constructor arguments of torch FSDP1's ``FullyShardedDataParallel``, read strictly:
torch's enums and config objects turned into ours, unsupported values refused with a clear
error, accepted-but-unhonoured ones warned about once per process (see the wrapper's docstring
for which is which)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from shardwise.fsdp.fsdp1_config import BackwardPrefetch, ShardingStrategy, as_enum
from shardwise.fsdp.mixed_precision import CPUOffload, MixedPrecision

_WARNED: set[str] = set()  # torch arguments already warned about (once per process)


def warn_once(name: str, message: str) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(message, UserWarning, stacklevel=4)


def check_unhonoured(backward_prefetch: Any, limit_all_gathers: bool,
                      use_orig_params: bool) -> None:
    if use_orig_params is not True:
        raise ValueError("use_orig_params=False is not supported: parameters are always the "
                         "original ones (Shard(0) DTensors over each unit's flat shard), as "
                         "with torch's use_orig_params=True; drop the argument")
    prefetch = None if backward_prefetch is None else as_enum(
        backward_prefetch, BackwardPrefetch, "backward_prefetch")
    if prefetch is not BackwardPrefetch.BACKWARD_PRE:
        warn_once("backward_prefetch", f"FullyShardedDataParallel(backward_prefetch="
                   f"{backward_prefetch}) is not honoured: backward always prefetches the "
                   "next unit's parameters (like BACKWARD_PRE)")
    if limit_all_gathers is not True:
        warn_once("limit_all_gathers", "FullyShardedDataParallel(limit_all_gathers=False) is "
                   "not honoured: in-flight all-gathers are always limited")


def group_of(group: dist.ProcessGroup | None, mesh: Any) -> tuple[dist.ProcessGroup, Any]:
    if mesh is None:
        return group or dist.group.WORLD, None
    if group is not None:
        raise TypeError("FullyShardedDataParallel takes process_group= or device_mesh=, "
                        "not both")
    if mesh.ndim != 1:
        raise NotImplementedError(f"a {mesh.ndim}D device_mesh means hybrid sharding, which "
                                  "is not supported yet; pass a 1D mesh")
    return mesh.get_group(), mesh


def strategy(strategy: Any, reshard_after_forward: bool) -> bool:
    if strategy is None:
        return reshard_after_forward
    kind = as_enum(strategy, ShardingStrategy, "sharding_strategy")
    if kind is ShardingStrategy.FULL_SHARD:
        return True
    if kind is ShardingStrategy.SHARD_GRAD_OP:
        return False
    raise NotImplementedError(f"sharding_strategy {kind.name} is not supported; use FULL_SHARD "
                              "or SHARD_GRAD_OP (or DistributedDataParallel for NO_SHARD)")


def ignored(module: nn.Module, ignored_modules: Any, ignored_states: Any
             ) -> tuple[list[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass ignored_modules= or ignored_states=, not both")
    items = list(ignored_modules or ignored_states or ())
    mods = [m for m in items if isinstance(m, nn.Module)]
    params = {p for p in items if isinstance(p, nn.Parameter)}
    others = [type(x).__name__ for x in items if not isinstance(x, nn.Module | nn.Parameter)]
    if others:
        raise TypeError(f"ignored modules/states must be nn.Module or nn.Parameter, got {others}")
    if module in mods:
        raise ValueError("the wrapped module itself cannot be ignored")
    for m in mods:
        params.update(m.parameters())
    return mods, params


def materialize(module: nn.Module, init_fn: Callable[[nn.Module], None],
                 ignored: list[nn.Module]) -> None:
    """torch FSDP1's ``param_init_fn``: called on each module holding meta-device tensors of
    its own (outside ignored modules), parents first."""
    skip = {id(p) for m in ignored for p in m.modules()}
    for m in list(module.modules()):
        if id(m) in skip:
            continue
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if any(t.is_meta for t in own):
            init_fn(m)


def as_mixed_precision(mp: Any) -> Any:
    """torch FSDP1's ``MixedPrecision`` as ours (its per-unit/root input casting collapses into
    one flag); ours or None as given."""
    if mp is None or isinstance(mp, MixedPrecision) or hasattr(mp, "output_dtype"):
        return mp
    if getattr(mp, "keep_low_precision_grads", False):
        warn_once("keep_low_precision_grads", "MixedPrecision(keep_low_precision_grads=True) "
                   "is not honoured: gradients are kept in the parameters' dtype")
    cast = bool(getattr(mp, "cast_forward_inputs", False)
                or getattr(mp, "cast_root_forward_inputs", True))
    return MixedPrecision(mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype, cast)


def as_cpu_offload(offload: Any) -> Any:
    if offload is None or isinstance(offload, CPUOffload):
        return offload
    if type(offload).__name__ == "CPUOffload":  # torch's
        return CPUOffload(bool(offload.offload_params))
    return offload


def no_optim_input(optim_input: Any) -> None:
    if optim_input is not None:
        raise TypeError("optim_input (deprecated in torch) is not supported: pass optim=")
