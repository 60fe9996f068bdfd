"""FSDP over tensor-parallel shards: FSDP on a data axis, TP on a model axis (2D).

[Note: FSDP x TP]
Tensor parallelism comes first: ``shard_module(model, plan, process_group=tp_group)`` leaves
each TP-sharded parameter as an ordinary ``nn.Parameter`` holding this rank's TP shard in its
module's ``_parameters``, and the ShardedTensor that forward reads looks that slot up live (see
[Note: how a sharded parameter appears], sharded_tensor/parametrize.py). ``fully_shard`` over
the data-parallel group then treats that Parameter like any other parameter of the TP-local
shape: its rows are split over dp (``torch.chunk`` semantics) into the unit's flat shard, the
all-gather over dp puts the whole TP-local tensor back into the slot for forward and backward
(so the ShardedTensor computes with it), and the gradient is reduce-scattered over dp only.
Nothing crosses the tp axis in FSDP: a TP shard's gradient belongs to its tp rank, and the
gradient of a TP-replicated parameter (layer norms, row-wise biases) is the same on every tp
rank because TP's own collectives make the activations' gradients so.

What this module changes is how the unit presents its sharded parameters. A unit that holds any
TP-sharded parameter presents all of its parameters as DTensors of their global shape on the 2D
mesh ``(dp, tp)``, as torch's FSDP2 does for a module parallelized by torch's TP:

- a parameter chunked by TP on dim ``d != 0``: ``(Shard(0), Shard(d))``;
- one chunked on dim 0: ``(_StridedShard(0, split_factor=tp), Shard(0))``: tp splits the rows
  first and dp splits each tp chunk (torch's "right-to-left" sharding);
- a TP-replicated parameter: ``(Shard(0), Replicate())``.

So ``torch.nn.utils.clip_grad_norm_`` counts every gradient element once across both axes (a
replicated parameter's partial norm is reduced over dp only), ``full_tensor()`` returns the whole
parameter, and ``state_dict()`` holds these DTensors, as torch's FSDP2 x TP does. A unit without
TP-sharded parameters stays on the 1D dp mesh. Hybrid sharding with TP (3D) is refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.distributed.data_parallel import global_ranks
from shardwise.fsdp.dtensor import _contiguous_stride as contiguous_stride
from shardwise.fsdp.dtensor import device_type_of
from shardwise.sharded_tensor import ChunkShardingSpec, ShardedTensor, sharded_parameters

MESH_DIM_NAMES = ("dp", "tp")
# (dp group, tp group) -> their 2D mesh (keyed by the group objects: groups made again over the
# same ranks are other groups)
_MESHES: dict[tuple, DeviceMesh] = {}


def tp_sharded(params: list) -> dict[int, ShardedTensor]:
    """``id(parameter) -> ShardedTensor`` for the unit's parameters that TP sharded;
    ``params`` is fully_shard's ``[(param, [(owner, name, fqn), ...]), ...]``."""
    found = {}
    for p, holders in params:
        for owner, name, _ in holders:
            st = sharded_parameters(owner).get(name)
            if st is not None:
                found[id(p)] = st
    return found


def compose(handle, params: list, replicate: dist.ProcessGroup | None) -> None:
    """Present the unit's parameters on the 2D (dp, tp) mesh if TP sharded any of them (see
    [Note: FSDP x TP]); nothing otherwise. One small all-gather over dp builds the mesh the first
    time a (dp, tp) pair of groups is seen."""
    tp = tp_sharded(params)
    if handle is None or not tp:
        return
    names = [holders[0][2] for _, holders in params]
    if replicate is not None:
        first = next(n for n, (p, _) in zip(names, params) if id(p) in tp)
        raise ValueError(f"fully_shard: {first} (and {len(tp) - 1} more) are tensor-parallel "
                         "shards; hybrid sharding (a 2D FSDP mesh) with tensor parallelism (3D) "
                         "is not supported: give fully_shard the 1D data-parallel mesh")
    tp_group = _one_group(tp, names, params)
    mesh = mesh_2d(handle.group, tp_group)
    for slot, (p, holders) in zip(handle.slots, params):
        st = tp.get(id(p))
        placements = _placements(st, mesh, holders[0][2])
        shape = st.shape if st is not None else torch.Size(slot.layout.shape)
        dt = DTensor.from_local(slot.local, mesh, placements, run_check=False, shape=shape,
                                stride=contiguous_stride(shape))
        slot.shard_param = nn.Parameter(dt, requires_grad=slot.requires_grad)
    handle.use_sharded_params()


def _one_group(tp: dict[int, ShardedTensor], names: list[str], params: list
               ) -> dist.ProcessGroup:
    groups = {id(st.process_group): st.process_group for st in tp.values()}
    if len(groups) > 1:
        sharded = [n for n, (p, _) in zip(names, params) if id(p) in tp]
        raise ValueError(f"fully_shard: the tensor-parallel parameters of one unit must share "
                         f"one process group; {sharded} use {len(groups)} different groups")
    group = next(iter(groups.values()))
    return group if group is not None else dist.group.WORLD


def mesh_2d(dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup) -> DeviceMesh:
    """The ``(dp, tp)`` DeviceMesh of these two groups (made once per pair, from the groups
    themselves: no new process group). Row ``i`` holds the tp group of dp rank ``i``: one
    all-gather of the tp groups' global ranks over dp."""
    dp_ranks = global_ranks(dp_group)
    tp_ranks = global_ranks(tp_group)
    key = (dp_group, tp_group)
    if key not in _MESHES:
        mine = torch.tensor(tp_ranks, dtype=torch.int64)
        if dist.get_backend(dp_group) == "nccl":
            mine = mine.cuda()
        rows = [torch.empty_like(mine) for _ in dp_ranks]
        dist.all_gather(rows, mine, group=dp_group)
        grid = torch.stack(rows).cpu()
        _check_grid(grid, dp_ranks, tp_ranks)
        _MESHES[key] = DeviceMesh.from_group([dp_group, tp_group], device_type_of(dp_group),
                                             mesh=grid, mesh_dim_names=MESH_DIM_NAMES)
    return _MESHES[key]


def _check_grid(grid: torch.Tensor, dp_ranks: list[int], tp_ranks: list[int]) -> None:
    me = dist.get_rank()
    column = tp_ranks.index(me)
    flat = grid.flatten().tolist()
    if grid[:, column].tolist() != dp_ranks or len(set(flat)) != len(flat):
        raise ValueError(f"fully_shard: the data-parallel group {dp_ranks} and the "
                         f"tensor-parallel group {tp_ranks} of rank {me} do not form a grid "
                         f"(the tp groups of the dp ranks are {grid.tolist()}); build both from "
                         "one 2D DeviceMesh: mesh['dp'] and mesh['tp']")


def _placements(st: ShardedTensor | None, mesh: DeviceMesh, name: str) -> list:
    if st is None:
        return [Shard(0), Replicate()]
    spec = st.sharding_spec()
    tp = mesh.size(1)
    # placements name global ranks ([Note: global ranks in placements]): chunk i must be on
    # the process at tp position i
    tp_ranks = global_ranks(mesh.get_group(1))
    ranks = [p.rank for p in spec.placements_list()] if isinstance(spec, ChunkShardingSpec) \
        else None
    if ranks != list(tp_ranks):
        raise ValueError(f"fully_shard: {name} is sharded as {spec!r}; FSDP x TP needs a "
                         f"ChunkShardingSpec whose chunk i is on the tp group's rank i (global "
                         f"ranks {list(tp_ranks)})")
    dim = spec.sharded_dim(st.dim())
    if dim == 0:
        return [_StridedShard(0, split_factor=tp), Shard(0)] if tp > 1 else [Shard(0), Shard(0)]
    return [Shard(0), Shard(dim)]



def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a unit's 2D DTensor of a TP shard (sharded on both axes)."""
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 2
            and not any(isinstance(p, Replicate) for p in param.placements))


def whole(param: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """The whole parameter, given the unit's gather of it over dp: for a TP shard, its 2D
    DTensor's ``full_tensor()`` (all-gathers over both axes), else ``gathered`` itself.
    Collective for TP shards: every rank calls it for the same parameters."""
    if not is_tp_sharded(param):
        return gathered
    with torch.no_grad():
        return param.full_tensor()


def tp_group_of(params: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The tp axis's group if any of ``params`` is a unit's 2D DTensor, else None."""
    for p in params:
        if isinstance(p, DTensor) and p.device_mesh.ndim == 2 and \
                p.device_mesh.mesh_dim_names == MESH_DIM_NAMES:
            return p.device_mesh.get_group(1)
    return None


def tp_copies(grad: torch.Tensor) -> int:
    """How many tp ranks hold the same values as this rank's part of ``grad``: the tp size for
    a TP-replicated parameter's 2D DTensor, else 1 (so a norm counts each element once)."""
    if isinstance(grad, DTensor) and grad.device_mesh.ndim == 2 and \
            grad.device_mesh.mesh_dim_names == MESH_DIM_NAMES and \
            isinstance(grad.placements[1], Replicate):
        return grad.device_mesh.size(1)
    return 1
