"""``fully_shard``: make a module an FSDP unit in place (the composable API, like torch's FSDP2).

Apply it bottom-up: first to each submodule that should be a unit of its own (e.g. every
transformer block), then to the root. Each call shards the parameters of the module that no
nested unit already owns (see [Note: flat parameters] in flat_param.py) and turns the module
into an ``FSDPModule`` (module.py); the module keeps its own methods and its names, and each
parameter becomes a ``Shard(0)`` DTensor over the unit's group (see layout.py), so
``state_dict()`` holds DTensors, as with torch's FSDP2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise._compat import flatten_mesh
from shardwise.dp.agree import check_same_model
from shardwise.fsdp import tp_params
from shardwise.fsdp.flat_param import FlatParamHandle
from shardwise.fsdp.fsdp1.policies import WrapPolicy, modules_to_wrap
from shardwise.fsdp.layout import check_shardable, local_tensor, mesh_for_group
from shardwise.fsdp.mixed_precision import (
    CPUOffload,
    MixedPrecision,
    as_mixed_precision,
    offloads_params,
    resolve_dtypes,
)
from shardwise.fsdp.module import FSDPModule, make_fsdp_class
from shardwise.fsdp.state_dict import register_state_dict_hooks
from shardwise.fsdp.unit import UNIT_ATTR, FSDPUnit, class_name, get_unit

# On gloo, a parameter whose chunk has at least this many elements is broadcast straight into
# its rows; smaller ones are gathered together and copied out (see [Note: FSDP layout]).
GLOO_DIRECT_MIN_NUMEL = 1 << 16


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: Any = None, offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None,
                process_group: dist.ProcessGroup | None = None,
                mixed_precision: MixedPrecision | None = None,
                cpu_offload: CPUOffload | None = None,
                auto_wrap_policy: WrapPolicy | None = None,
                forward_prefetch: bool = True,
                dp_mesh_dims: Any = None) -> FSDPModule:
    """Shard ``module``'s parameters over a group and gather them around its forward and
    backward (one all-gather before each, one reduce-scatter of the gradients after backward);
    returns ``module``, now an ``FSDPModule``. A list of modules makes one unit of all of them
    (torch FSDP2's form for modules that run together or share parameters, e.g. a final norm
    and the output head): each becomes an ``FSDPModule`` of that unit, and the list is
    returned ([Note: one unit over several modules], unit.py).

    torch FSDP2's arguments: ``mesh`` (a 1D ``DeviceMesh`` to shard over, default: the world
    group; or a 2D one for hybrid sharding, HSDP: parameters sharded and gathered along dim 1,
    gradients reduce-scattered along dim 1 and then all-reduced along dim 0),
    ``reshard_after_forward`` (default True: free the gathered parameters after forward and
    gather again in backward; False keeps them, one all-gather per step instead of two, more
    memory), ``shard_placement_fn`` (only ``Shard(0)``, or None, is supported), ``mp_policy``
    (``MixedPrecisionPolicy``), ``offload_policy`` (``CPUOffloadPolicy``), ``ignored_params``
    (left unsharded and unreduced), ``dp_mesh_dims`` (a ``DataParallelMeshDims`` naming the
    data-parallel dimensions of ``mesh``: see ``_data_parallel_mesh``). Ours as well:
    ``process_group`` instead of ``mesh``,
    ``mixed_precision`` / ``cpu_offload`` (FSDP1's names), ``auto_wrap_policy`` (apply
    ``fully_shard`` with the same options to the submodules it picks first) and
    ``forward_prefetch`` (read on the root; default True: issue the next unit's all-gather
    while the current unit computes its forward, one unit more of memory; False gathers each
    unit when its forward starts, see [Note: FSDP schedule]).
    """
    modules = _modules_of(module)
    for each in modules:
        check_not_wrapped(each, UNIT_ATTR)
    group, replicate, mesh = _groups_and_mesh(_data_parallel_mesh(mesh, dp_mesh_dims),
                                              process_group)
    reshard = _reshard_flag(reshard_after_forward)
    mp = _one_of("mp_policy", mp_policy, "mixed_precision", mixed_precision)
    offload = _one_of("offload_policy", offload_policy, "cpu_offload", cpu_offload)
    mp = as_mixed_precision(mp)
    ignored = set(ignored_params or ())
    if auto_wrap_policy is not None:
        for sub in [s for each in modules for s in modules_to_wrap(each, auto_wrap_policy)]:
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp,
                        offload_policy=offload, ignored_params=ignored,
                        forward_prefetch=forward_prefetch)
    for each in modules:  # before any collective relies on it
        check_same_model(each, group, what="fully_shard")
    children = list(dict.fromkeys(u for each in modules for u in _child_units(each)))
    params, homes = _group_params(modules, children, ignored)
    tp = tp_params.tp_layouts(params)  # parameters that tensor parallelism laid out
    _check_placements(params, shard_placement_fn)
    handle = _make_handle(modules[0], params, (group, replicate), mesh, mp,
                          offloads_params(offload), tp)
    if handle is not None:
        for slot, slot_homes in zip(handle.slots, homes):
            slot.homes = slot_homes
    names = [holders[0][2] for _, holders in params]
    tp_params.present_2d(handle, tp, names, mesh, replicate)  # see [Note: FSDP x TP]
    for each in modules:
        _cast_buffers(each, mp)
    unit = FSDPUnit(modules[0], handle, group, reshard, mp, children, modules=modules)
    unit.forward_prefetch = forward_prefetch
    for each in modules:
        setattr(each, UNIT_ATTR, unit)
        make_fsdp_class(each)
    register_state_dict_hooks(unit)
    return module  # type: ignore[return-value]


def _modules_of(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules of one unit: ``module`` itself, or the modules of torch FSDP2's list form
    ([Note: one unit over several modules], unit.py), checked to be distinct modules none of
    which contains another."""
    if not isinstance(module, (list, tuple)):
        if not isinstance(module, nn.Module):
            raise TypeError(f"fully_shard needs an nn.Module, got {type(module).__name__}")
        return [module]
    modules = list(module)
    if not modules:
        raise ValueError("fully_shard of an empty list of modules: give at least one module")
    for each in modules:
        if not isinstance(each, nn.Module):
            raise TypeError(f"fully_shard of a list needs nn.Modules, got "
                            f"{type(each).__name__} in it")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard of a list: a module appears in it twice")
    for outer in modules:
        for inner in modules:
            if inner is not outer and any(sub is inner for sub in outer.modules()):
                raise ValueError(
                    f"fully_shard of a list: {type(inner).__name__} is inside "
                    f"{type(outer).__name__}, also in the list; list modules that do not "
                    "contain each other (a module's parameters belong to one unit)")
    return modules


def _group_params(modules: list[nn.Module], children: list[FSDPUnit], ignored: set
                  ) -> tuple[list, list[list[int]]]:
    """The unit's parameters over all its modules (each shared parameter once, with every
    place that holds it, names relative to the module of the list that holds it), and for
    each parameter the index in ``modules`` of each of those places."""
    found: dict[int, tuple[nn.Parameter, list]] = {}
    homes: dict[int, list[int]] = {}
    for home, each in enumerate(modules):
        for p, holders in _unit_params(each, children):
            if p in ignored:
                continue
            found.setdefault(id(p), (p, []))[1].extend(holders)
            homes.setdefault(id(p), []).extend([home] * len(holders))
    return list(found.values()), [homes[key] for key in found]


def _data_parallel_mesh(mesh: DeviceMesh | None, dims: Any) -> DeviceMesh | None:
    """The mesh to shard over, given torch's ``dp_mesh_dims`` (a ``DataParallelMeshDims``:
    which named dimensions of ``mesh`` are data-parallel). Several shard (or replicate)
    dimensions are flattened into one, as torch does; with a replicate dimension the result is
    2D (replicate, shard), HSDP. Every other dimension of ``mesh`` must have size 1: parameters
    that are DTensors over more dimensions (tensor parallelism on the same full mesh) are
    torch's SPMD form, which shardwise does not take; its 2D form does (TP applied on
    ``mesh["tp"]``, then ``fully_shard(..., mesh=mesh["dp"])``)."""
    if dims is None:
        return mesh
    if mesh is None:
        raise TypeError("fully_shard: dp_mesh_dims= names dimensions of mesh=, which is missing")
    shard, replicate = _dim_names(dims.shard), _dim_names(dims.replicate)
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in shard + replicate if n not in names]
    if unknown or not shard:
        raise ValueError(f"fully_shard: dp_mesh_dims={dims!r} must name at least one shard "
                         f"dimension, all of them among the mesh's {names}; "
                         f"unknown: {unknown}")
    others = [n for n in names if n not in shard + replicate and mesh[n].size() > 1]
    if others:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims over a mesh whose other dimensions {others} have more "
            "than one rank (parameters as DTensors on the full mesh) is not supported; apply "
            "tensor parallelism on mesh[tp] and pass fully_shard(..., mesh=mesh[dp])")
    flat_shard = _one_dimension(mesh, shard)
    if not replicate:
        return flat_shard
    if len(replicate) > 1 or len(shard) > 1:
        raise NotImplementedError("fully_shard: dp_mesh_dims with several replicate or shard "
                                  "dimensions together (HSDP over flattened dimensions) is "
                                  "not supported; name one of each")
    return mesh[replicate + shard]


def _dim_names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _one_dimension(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    sub = mesh[names[0]] if len(names) == 1 else mesh[names]
    return sub if len(names) == 1 else flatten_mesh(sub)


def _groups_and_mesh(mesh: DeviceMesh | None, group: dist.ProcessGroup | None
                     ) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, DeviceMesh]:
    """``(shard group, replicate group or None, mesh)``: a 1D mesh (or a group) shards over
    all of it; a 2D mesh replicates along dim 0 and shards along dim 1 (HSDP)."""
    if mesh is not None and group is not None:
        raise TypeError("fully_shard takes mesh= or process_group=, not both")
    if mesh is None:
        group = group or dist.group.WORLD
        return group, None, mesh_for_group(group)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh.get_group(), None, mesh
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0), mesh
    raise ValueError(f"fully_shard takes a 1D mesh (shard) or a 2D mesh (replicate, shard), "
                     f"got a {mesh.ndim}D mesh of shape {tuple(mesh.shape)}")


def _reshard_flag(value: bool | int | None) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"reshard_after_forward={value!r}: only True or False is supported "
                         "(resharding to a smaller group after forward is not)")
    return value


def _one_of(name: str, value: Any, old_name: str, old_value: Any) -> Any:
    if value is not None and old_value is not None:
        raise TypeError(f"fully_shard takes {name}= or {old_name}=, not both")
    return value if value is not None else old_value


def _check_placements(params, placement_fn) -> None:
    for p, holders in params:
        check_shardable(holders[0][2], local_tensor(p).shape)
        if placement_fn is None:
            continue
        placement = placement_fn(p)
        if placement is not None and getattr(placement, "dim", None) != 0:
            raise ValueError(f"shard_placement_fn gave {placement!r} for {holders[0][2]}: "
                             "only Shard(0) (or None) is supported")


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
            check_not_shared_with_child(prefix + name, p, taken)
            found.setdefault(id(p), (p, []))[1].append((owner, name, prefix + name))
    return list(found.values())


def _make_handle(module: nn.Module, params, groups: tuple, mesh: DeviceMesh,
                 mp: Any, offload: bool, tp: list) -> FlatParamHandle | None:
    if not params:
        return None
    group, replicate = groups
    named = [(holders[0][2], p) for p, holders in params]
    device = check_same_device(module, named)
    dtype = check_same_dtype(module, named)
    backend = dist.get_backend(group)
    if device.type != "meta":
        check_backend_device(backend, device, offload)
    param_dtype, reduce_dtype = resolve_dtypes(mp, dtype)
    direct = GLOO_DIRECT_MIN_NUMEL if backend == "gloo" else math.inf
    return FlatParamHandle(params, group, mesh, param_dtype, reduce_dtype, device, offload,
                           direct, replicate, tp)


def _cast_buffers(module: nn.Module, mp: Any) -> None:
    if mp is None or getattr(mp, "buffer_dtype", None) is None:
        return
    for _, owner in _walk_unowned(module):
        for name, b in owner._buffers.items():
            if b is not None and b.is_floating_point():
                owner._buffers[name] = b.to(mp.buffer_dtype)


# ---- validation of what is wrapped: errors that name the offending parameters ---------------
def check_same_device(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> torch.device:
    """All of a unit's parameters must live on one device; return it."""
    devices: dict[torch.device, list[str]] = {}
    for name, p in named:
        devices.setdefault(p.device, []).append(name)
    if len(devices) > 1:
        where = "; ".join(f"{d}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                          for d, names in devices.items())
        raise ValueError(
            f"FSDP: the parameters of {class_name(module)} live on different devices "
            f"({where}); move the module to one device before wrapping it"
        )
    return next(iter(devices))


def check_same_dtype(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> torch.dtype:
    dtypes: dict[torch.dtype, list[str]] = {}
    for name, p in named:
        dtypes.setdefault(p.dtype, []).append(name)
    if len(dtypes) > 1:
        where = "; ".join(f"{d}: {', '.join(n[:4])}" for d, n in dtypes.items())
        raise ValueError(f"FSDP: the parameters of one unit ({class_name(module)}) must share "
                         f"a dtype to be flattened together, found {where}")
    dtype = next(iter(dtypes))
    if not dtype.is_floating_point:
        raise ValueError(f"FSDP shards floating-point parameters, {class_name(module)} has "
                         f"{dtype} parameters")
    return dtype


def check_backend_device(backend: str, device: torch.device, offload: bool) -> None:
    """NCCL moves only CUDA tensors: parameters must be on the GPU (CPU offload keeps the shards
    on the CPU but still computes and communicates on the GPU)."""
    if backend == "nccl" and device.type != "cuda":
        hint = ("CPU offload still needs the module on the GPU: it moves only the shards to the "
                "CPU" if offload else "move the module to its CUDA device")
        raise ValueError(
            f"FSDP: the process group uses NCCL, which communicates only CUDA tensors, but the "
            f"parameters are on {device}{' with cpu_offload' if offload else ''}; {hint}"
        )


def check_not_wrapped(module: nn.Module, attr: str) -> None:
    if getattr(module, attr, None) is not None:
        raise RuntimeError(
            f"fully_shard was already applied to this {class_name(module)}; applying it "
            "twice would shard its (already sharded) parameters again"
        )


def check_not_shared_with_child(name: str, param: nn.Parameter, child_ids: dict[int, str]
                                ) -> None:
    if id(param) in child_ids:
        raise ValueError(
            f"FSDP: parameter {name} is shared with {child_ids[id(param)]}, which belongs to a "
            "nested unit; shared (tied) parameters must belong to one unit, so wrap the modules "
            "that share it inside the same unit (e.g. keep both in the root)"
        )
