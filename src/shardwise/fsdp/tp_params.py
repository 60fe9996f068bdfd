"""FSDP over tensor-parallel parameters: each TP shard's local tensor sharded again over dp.

[Note: FSDP x TP]
Tensor parallelism comes first, by either of two means, and ``fully_shard`` over the
data-parallel mesh dimension takes both the same way:

- torch's ``parallelize_module`` leaves each parallelized parameter an ``nn.Parameter`` holding
  a ``DTensor`` on the tp mesh (``Shard(0)`` column-wise, ``Shard(1)`` row-wise,
  ``Replicate()`` for biases and ``SequenceParallel`` norms);
- our ``shard_module`` leaves an ordinary Parameter holding this rank's TP shard, read live by
  the module's ShardedTensor (see [Note: how a sharded parameter appears]); its layout is the
  same as a DTensor ``Shard(d)`` on a 1D mesh over its group (sharded_tensor/dtensor_layout.py).

``tp_layouts`` describes each parameter by a ``TPLayout`` (tp mesh, placements, global shape),
or None for a parameter TP left alone. The unit's flat buffers then hold the LOCAL tensors: the
rows of each TP shard are split over dp (``torch.chunk`` semantics) into the flat shard, the
all-gather over dp puts the whole TP-local tensor back, and the reduce-scatter of gradients runs
over dp only. While gathered, the module reads what TP made: for torch's TP the TP DTensor again
(an autograd leaf wrapping the gathered local tensor, so torch's TP hooks and DTensor ops run;
its gradient is first redistributed to the parameter's own tp placements, as torch's FSDP2
does, so a ``Partial`` gradient of a replicated parameter is summed over tp), for ours the plain
local tensor. TP's own reductions stay with DTensor and the ShardedTensor ops.

Between steps a unit holding any TP parameter presents every parameter as a DTensor of its
global shape on the 2D ``(dp, tp)`` mesh, as torch's FSDP2 does:

- a parameter TP-sharded on dim ``d != 0``: ``(Shard(0), Shard(d))``;
- one TP-sharded on dim 0: ``(_StridedShard(0, split_factor=tp), Shard(0))``: tp splits the
  rows first and dp splits each tp chunk;
- a TP-replicated parameter (and one that TP left alone): ``(Shard(0), Replicate())``.

The 2D mesh is torch's concatenation of the dp and tp meshes when both are slices of one mesh
(``init_device_mesh``, torch's or ours), else a mesh made from the two groups. So
``torch.nn.utils.clip_grad_norm_`` and ours count every gradient element once over both axes,
``full_tensor()`` returns the whole parameter, and ``state_dict()`` holds these DTensors, which
DCP saves and loads onto any other layout. Hybrid sharding with TP (3D) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise._compat import (
    DTensor,
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    concatenate_meshes,
)
from shardwise._compat import StridedShard as _StridedShard
from shardwise.distributed.groups import collective_device, global_ranks, group_alive
from shardwise.fsdp.collectives import gather_from_each
from shardwise.fsdp.layout import _contiguous_stride as contiguous_stride
from shardwise.fsdp.layout import device_type_of
from shardwise.sharded_tensor import sharded_parameters
from shardwise.sharded_tensor.dtensor_layout import dtensor_placements


class GroupMeshes:
    """Meshes made here, by the process groups each is made over, so that a group gets one
    mesh (and the collective that builds a 2D one runs once on every rank). An entry goes when
    any of its groups is destroyed: c10d has no destroy callback, so every lookup first drops
    the entries of destroyed groups, and what is kept is bounded by the groups alive."""

    def __init__(self) -> None:
        self._entries: dict[tuple[dist.ProcessGroup, ...], DeviceMesh] = {}

    def get(self, groups: tuple[dist.ProcessGroup, ...],
            make: Callable[[], DeviceMesh]) -> DeviceMesh:
        """The mesh over ``groups``, made by ``make()`` the first time."""
        self.drop_destroyed()
        if groups not in self._entries:
            self._entries[groups] = make()
        return self._entries[groups]

    def meshes(self) -> list[DeviceMesh]:
        self.drop_destroyed()
        return list(self._entries.values())

    def __contains__(self, groups: tuple[dist.ProcessGroup, ...]) -> bool:
        self.drop_destroyed()
        return groups in self._entries

    def drop_destroyed(self) -> None:
        for key in [k for k in self._entries if not all(group_alive(g) for g in k)]:
            del self._entries[key]


_MESHES = GroupMeshes()  # (dp group, tp group) -> their 2D mesh: the FSDP x TP meshes
_TP_MESHES = GroupMeshes()  # (shard_module's group,) -> its 1D mesh


@dataclass(frozen=True)
class TPLayout:
    """How tensor parallelism laid out one parameter."""

    mesh: DeviceMesh  # the 1D tp mesh
    placements: tuple[Placement, ...]  # on ``mesh``
    shape: torch.Size  # global
    as_dtensor: bool  # the module reads it as a DTensor (torch's TP), else as its local tensor

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    def spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The TP DTensor's spec with ``dtype`` (the unit's compute dtype)."""
        meta = TensorMeta(self.shape, contiguous_stride(self.shape), dtype)
        return DTensorSpec(self.mesh, self.placements, tensor_meta=meta)


def tp_layouts(params: list) -> list[TPLayout | None]:
    """One entry per parameter of fully_shard's ``[(param, [(owner, name, fqn), ...]), ...]``:
    its TP layout, or None. Raises ValueError for a layout FSDP cannot shard further."""
    out = []
    for p, holders in params:
        name = holders[0][2]
        if isinstance(p, DTensor):
            out.append(_of_dtensor(p, name))
            continue
        st = next((sharded_parameters(o).get(n) for o, n, _ in holders
                   if n in sharded_parameters(o)), None)
        out.append(None if st is None else _of_sharded_tensor(st, name))
    return out


def _of_dtensor(p: DTensor, name: str) -> TPLayout:
    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard: {name} is a DTensor on a {mesh.ndim}D mesh "
                         f"{tuple(mesh.shape)}; FSDP shards parameters of 1D tensor "
                         "parallelism (a DTensor on mesh['tp'])")
    if any(isinstance(pl, Partial) for pl in p.placements):
        raise ValueError(f"fully_shard: {name} is a Partial DTensor {p.placements}; a "
                         "parameter must be Shard or Replicate")
    return TPLayout(mesh, tuple(p.placements), p.shape, True)


def _of_sharded_tensor(st, name: str) -> TPLayout:
    group = st.process_group if st.process_group is not None else dist.group.WORLD
    mesh = _TP_MESHES.get((group,), lambda: DeviceMesh.from_group(group, device_type_of(group)))
    try:
        placements = dtensor_placements(st, name)
    except ValueError as e:
        raise ValueError(f"fully_shard: {e}") from None
    return TPLayout(mesh, placements, st.shape, False)


def tp_mesh_of(layouts: list[TPLayout | None], names: list[str]) -> DeviceMesh | None:
    """The one tp mesh of a unit's TP parameters (None without any)."""
    found = [(n, lay) for n, lay in zip(names, layouts) if lay is not None]
    if not found:
        return None
    groups = {id(lay.group): lay.group for _, lay in found}
    if len(groups) > 1:
        raise ValueError(f"fully_shard: the tensor-parallel parameters of one unit must share "
                         f"one process group; {[n for n, _ in found]} use {len(groups)} "
                         "different groups")
    return found[0][1].mesh


def present_2d(handle, layouts: list[TPLayout | None], names: list[str],
               dp_mesh: DeviceMesh, replicate: dist.ProcessGroup | None) -> None:
    """Give the unit's sharded parameters their 2D DTensors (see [Note: FSDP x TP]); nothing
    for a unit without TP parameters. One small all-gather over dp builds the mesh the first
    time a (dp, tp) pair of groups is seen, unless both are slices of one mesh."""
    tp_mesh = tp_mesh_of(layouts, names)
    if handle is None or tp_mesh is None:
        return
    if replicate is not None:
        tp = [n for n, lay in zip(names, layouts) if lay is not None]
        raise ValueError(f"fully_shard: {tp[0]} (and {len(tp) - 1} more) are tensor-parallel "
                         "shards; hybrid sharding (a 2D FSDP mesh) with tensor parallelism (3D) "
                         "is not supported: give fully_shard the 1D data-parallel mesh")
    mesh = mesh_2d(dp_mesh, handle.group, tp_mesh)
    for slot, layout in zip(handle.slots, layouts):
        shape = layout.shape if layout is not None else slot.shape
        dt = DTensor.from_local(slot.local, mesh, placements_2d(layout), run_check=False,
                                shape=shape, stride=contiguous_stride(shape))
        slot.shard_param = nn.Parameter(dt, requires_grad=slot.requires_grad)
    handle.use_sharded_params()


def placements_2d(layout: TPLayout | None) -> tuple[Placement, ...]:
    """FSDP2's ``(dp, tp)`` placements of a parameter with this TP layout."""
    if layout is None:
        return (Shard(0), Replicate())
    split = 1  # how many pieces tp cuts dim 0 into
    for pl, size in zip(layout.placements, layout.mesh.shape):
        if isinstance(pl, Shard) and pl.dim % len(layout.shape) == 0:
            split *= size
    dp = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    return (dp, *layout.placements)


def mesh_2d(dp_mesh: DeviceMesh, dp_group: dist.ProcessGroup, tp_mesh: DeviceMesh
            ) -> DeviceMesh:
    """The ``(dp, tp)`` DeviceMesh: torch's concatenation when both meshes are named slices of
    one mesh; else one made from the two groups (no new process group; row ``i`` holds the tp
    group of dp rank ``i``: one all-gather of the tp groups' global ranks over dp)."""
    tp_group = tp_mesh.get_group()

    def make() -> DeviceMesh:
        mesh = _concatenated(dp_mesh, tp_mesh)
        return mesh if mesh is not None else _from_groups(dp_group, tp_group)

    return _MESHES.get((dp_group, tp_group), make)


def _concatenated(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    if dp_mesh.ndim != 1 or not dp_mesh.mesh_dim_names or not tp_mesh.mesh_dim_names:
        return None
    try:
        return concatenate_meshes([dp_mesh, tp_mesh])
    except (RuntimeError, AttributeError, ValueError, TypeError):
        return None  # not slices of one mesh (or a torch without _concatenate)


def _from_groups(dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup) -> DeviceMesh:
    dp_ranks, tp_ranks = global_ranks(dp_group), global_ranks(tp_group)
    mine = torch.tensor(tp_ranks, dtype=torch.int64, device=collective_device(dp_group))
    grid = torch.stack(gather_from_each(mine, dp_group)).cpu()
    _check_grid(grid, dp_ranks, tp_ranks)
    return DeviceMesh.from_group([dp_group, tp_group], device_type_of(dp_group), mesh=grid,
                                 mesh_dim_names=("dp", "tp"))


def _check_grid(grid: torch.Tensor, dp_ranks: list[int], tp_ranks: list[int]) -> None:
    me = dist.get_rank()
    column = tp_ranks.index(me)
    flat = grid.flatten().tolist()
    if grid[:, column].tolist() != dp_ranks or len(set(flat)) != len(flat):
        raise ValueError(f"fully_shard: the data-parallel group {dp_ranks} and the "
                         f"tensor-parallel group {tp_ranks} of rank {me} do not form a grid "
                         f"(the tp groups of the dp ranks are {grid.tolist()}); build both from "
                         "one 2D DeviceMesh: mesh['dp'] and mesh['tp']")


def is_fsdp_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor on one of the 2D meshes made here (FSDP x TP)."""
    return isinstance(t, DTensor) and any(t.device_mesh is m for m in _MESHES.meshes())


def whole(param: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """The whole parameter, given the unit's gather of it over dp: for a 2D parameter sharded
    over tp, ``full_tensor()`` (all-gathers over both axes), else ``gathered`` itself.
    Collective for those: every rank calls it for the same parameters."""
    if not is_fsdp_tp(param) or all(isinstance(p, Replicate) for p in param.placements[1:]):
        return gathered
    with torch.no_grad():
        return param.full_tensor()


def mesh_groups_of(params: list[torch.Tensor]
                   ) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """``(dp group, tp group)`` of the 2D mesh if any of ``params`` is an FSDP x TP DTensor,
    else None."""
    for p in params:
        if is_fsdp_tp(p):
            return p.device_mesh.get_group(0), p.device_mesh.get_group(1)
    return None


def tp_copies(grad: torch.Tensor) -> int:
    """How many tp ranks hold the same values as this rank's part of ``grad``: the tp size for
    a TP-replicated parameter's 2D DTensor, else 1 (so a norm counts each element once)."""
    if is_fsdp_tp(grad) and isinstance(grad.placements[1], Replicate):
        return grad.device_mesh.size(1)
    return 1


def local_grad(grad: torch.Tensor, layout: TPLayout | None) -> torch.Tensor:
    """The local tensor of an unsharded parameter's gradient: a DTensor gradient is first
    redistributed to the parameter's tp placements (a ``Partial`` one is summed over tp: an
    all-reduce over the tp group, as torch's FSDP2 does)."""
    if not isinstance(grad, DTensor):
        return grad
    if layout is not None and tuple(grad.placements) != layout.placements:
        grad = grad.redistribute(layout.mesh, layout.placements)
    return grad._local_tensor
