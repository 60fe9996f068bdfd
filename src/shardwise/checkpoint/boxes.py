"""Boxes of a global tensor and the local chunks each kind of tensor holds, as pure math.

A box is ``(offsets, sizes)``: the region ``[offsets[d], offsets[d] + sizes[d])`` on every dim
of the global tensor. A plain tensor is one box covering everything (replicated: every rank
holds it); a DTensor's local tensor is the box ``compute_local_shape_and_global_offset`` gives
(Shard / Replicate placements on any mesh, and the ``_StridedShard`` that FSDP x TP puts on the
data-parallel axis: FSDP's rows of a TP shard are still one box); a ShardedTensor's local shards
carry their boxes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise._compat import (
    DTensor,
    Replicate,
    Shard,
    compute_local_shape_and_global_offset,
    local_box_at,
)
from shardwise._compat import StridedShard as _StridedShard
from shardwise.checkpoint.tiling import tiling_fault
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharded_tensor.metadata import Box


@dataclass
class LocalChunk:
    """One box of a global tensor that this rank holds, with its data (``tensor.shape`` is the
    box's sizes)."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def box(self) -> Box:
        return self.offsets, tuple(self.tensor.shape)


def global_shape(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)


def local_chunks(key: str, value: Any) -> list[LocalChunk]:
    """The boxes of ``value`` this rank holds (no collective)."""
    if isinstance(value, ShardedTensor):
        return [LocalChunk(tuple(s.metadata.shard_offsets), s.tensor)
                for s in value.local_shards()]
    if isinstance(value, DTensor):
        return [_dtensor_chunk(key, value)]
    return [LocalChunk((0,) * value.dim(), value)]


def _dtensor_chunk(key: str, value: DTensor) -> LocalChunk:
    for p in value.placements:
        if type(p) not in (Shard, Replicate, _StridedShard):
            raise ValueError(f"{key}: DTensor placement {p} is not supported by the checkpoint "
                             "(only Shard, _StridedShard and Replicate; redistribute a Partial "
                             "first)")
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: torch's answer for that case
        shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                               value.placements)
    else:
        offsets, shape = dtensor_box(value.shape, value.device_mesh.shape, coordinate,
                                     value.placements)
    local = value._local_tensor
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"{key}: the DTensor's local tensor has shape {tuple(local.shape)}, "
                         f"its placements give {tuple(shape)}")
    return LocalChunk(tuple(int(o) for o in offsets), local)


def dtensor_box(shape, mesh_shape, coordinate, placements) -> Box:
    """The box (offsets, sizes) that a DTensor of global ``shape`` and ``placements`` holds at
    ``coordinate`` of a mesh of ``mesh_shape``: this rank's, or any rank's (a dry run)."""
    sizes, offsets = local_box_at(tuple(shape), tuple(mesh_shape), list(coordinate),
                                  placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def numel(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def check_cover(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise ValueError unless ``boxes`` lie inside ``shape`` and tile the whole tensor without
    overlapping (no gap, no element twice); O(n log n) in the number of boxes
    ([Note: exact tiling by corner counts] in tiling.py)."""
    fault = tiling_fault(shape, boxes)
    if fault is None:
        return
    if fault.kind in ("dims", "outside"):
        raise ValueError(f"{name}: the chunk {boxes[fault.first]} lies outside the tensor's "
                         f"global shape {tuple(shape)}")
    if fault.kind == "overlap":
        raise ValueError(f"{name}: ranks hold overlapping but different chunks "
                         f"{boxes[fault.first]} and {boxes[fault.second]} (both hold the "
                         f"element at {fault.point}); the checkpoint cannot tell which one to "
                         "keep")
    if fault.covered < fault.total:
        raise ValueError(f"{name}: the ranks' chunks cover {fault.covered} of the {fault.total} "
                         f"elements of its global shape {tuple(shape)} (none holds the element "
                         f"at {fault.point})")
    raise ValueError(f"{name}: the chunks overlap: their sizes add up to {fault.covered} "
                     f"elements, its global shape {tuple(shape)} has {fault.total}, and none "
                     f"holds the element at {fault.point}")


def rows_and_row_numel(sizes: Sequence[int]) -> tuple[int, int]:
    """A chunk seen as rows along dim 0 (a 0-dim tensor is one row of one element)."""
    if len(sizes) == 0:
        return 1, 1
    return int(sizes[0]), numel(sizes[1:])
