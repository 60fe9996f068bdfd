"""The constructor arguments of torch FSDP1's ``FullyShardedDataParallel``, read strictly:
torch's enums and config objects turned into ours, unsupported values refused with a clear
error, accepted-but-unhonoured ones warned about once per process (see the wrapper's docstring
for which is which)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed.mesh import init_device_mesh
from shardwise.distributed.topology import (
    HSDP_DIM_NAMES,
    hybrid_mesh_shape,
    local_world_size_from_env,
)
from shardwise.fsdp.collectives import gather_from_each
from shardwise.fsdp.fsdp1.config import BackwardPrefetch, ShardingStrategy, as_enum
from shardwise.fsdp.layout import device_type_of
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


@dataclass(frozen=True)
class Layout:
    """Where a FullyShardedDataParallel shards and replicates."""

    group: dist.ProcessGroup  # the shard group (torch's ``process_group`` attribute)
    mesh: Any  # a DeviceMesh for fully_shard, or None to shard over ``group``
    reshard_after_forward: bool
    sync_group: dist.ProcessGroup  # every replica of every shard: sync_module_states' group


def layout_of(strategy: Any, group: Any, mesh: Any, reshard_after_forward: bool) -> Layout:
    """torch's sharding strategies on our runtime: FULL_SHARD and SHARD_GRAD_OP shard over the
    group (or 1D mesh); HYBRID_SHARD and _HYBRID_SHARD_ZERO2 shard within a shard group and
    replicate across groups (a 2D ``device_mesh``, ``process_group=(shard, replicate)``, or by
    default shards within a node as torchrun's LOCAL_WORLD_SIZE says); NO_SHARD replicates
    (a (world, 1) mesh: gathers are no-ops, gradients are all-reduced)."""
    if mesh is not None and group is not None:
        raise TypeError("FullyShardedDataParallel takes process_group= or device_mesh=, "
                        "not both")
    kind = ShardingStrategy.FULL_SHARD if strategy is None else as_enum(
        strategy, ShardingStrategy, "sharding_strategy")
    if kind in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        reshard = reshard_after_forward if strategy is None else (
            kind is ShardingStrategy.FULL_SHARD)
        return _flat_layout(group, mesh, reshard)
    if kind is ShardingStrategy.NO_SHARD:
        if mesh is not None or isinstance(group, tuple):
            raise ValueError("NO_SHARD takes one process group (every rank a replica)")
        group = group or dist.group.WORLD
        return _hybrid_layout(_no_shard_mesh(group), reshard_after_forward)
    reshard = kind is ShardingStrategy.HYBRID_SHARD
    return _hybrid_layout(_hybrid_mesh(group, mesh), reshard)


def _flat_layout(group: Any, mesh: Any, reshard: bool) -> Layout:
    if isinstance(group, tuple):
        raise ValueError("process_group=(shard, replicate) goes with a HYBRID sharding_strategy")
    if mesh is None:
        group = group or dist.group.WORLD
        return Layout(group, None, reshard, group)
    if mesh.ndim != 1:
        raise ValueError(f"a {mesh.ndim}D device_mesh means hybrid sharding: pass "
                         "sharding_strategy=ShardingStrategy.HYBRID_SHARD with it")
    return Layout(mesh.get_group(), mesh, reshard, mesh.get_group())


def _hybrid_layout(mesh: DeviceMesh, reshard: bool) -> Layout:
    return Layout(mesh.get_group(1), mesh, reshard, dist.group.WORLD)


def _hybrid_mesh(group: Any, mesh: Any) -> DeviceMesh:
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(f"hybrid sharding needs a 2D device_mesh (replicate, shard), got "
                             f"a {mesh.ndim}D one of shape {tuple(mesh.shape)}")
        return mesh
    if isinstance(group, tuple):
        if len(group) != 2:
            raise ValueError("process_group for hybrid sharding is a pair (shard group, "
                             f"replicate group), got {len(group)} groups")
        return _mesh_from_groups(*group)
    if group is not None:
        raise ValueError("hybrid sharding takes process_group=(shard group, replicate group) "
                         "or a 2D device_mesh; one group is ambiguous")
    world = dist.get_world_size()
    shape = hybrid_mesh_shape(world, local_world_size_from_env(world))
    return init_device_mesh(device_type_of(), shape, HSDP_DIM_NAMES)


def _no_shard_mesh(group: dist.ProcessGroup) -> DeviceMesh:
    if group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError("NO_SHARD on a subgroup is not supported; use DistributedDataParallel")
    return init_device_mesh(device_type_of(), (dist.get_world_size(), 1), HSDP_DIM_NAMES)


def _mesh_from_groups(shard: dist.ProcessGroup, replicate: dist.ProcessGroup) -> DeviceMesh:
    """The (replicate, shard) mesh of two given groups: every rank tells the world its place
    (one all-gather of three integers), so that every rank knows the whole grid."""
    me = torch.tensor([dist.get_rank(replicate), dist.get_rank(shard), dist.get_rank()])
    places = gather_from_each(me)
    grid = torch.full((dist.get_world_size(replicate), dist.get_world_size(shard)), -1)
    for r, s, g in (p.tolist() for p in places):
        grid[r, s] = g
    if (grid < 0).any() or grid.numel() != dist.get_world_size():
        raise ValueError(f"process_group=(shard, replicate) groups of sizes "
                         f"{dist.get_world_size(shard)} and {dist.get_world_size(replicate)} do "
                         f"not tile the world of {dist.get_world_size()} ranks")
    return DeviceMesh.from_group([replicate, shard], device_type_of(), mesh=grid,
                                 mesh_dim_names=HSDP_DIM_NAMES)


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
