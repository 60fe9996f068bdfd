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

from shardwise._compat import DTensor, Replicate, Shard, compute_local_shape_and_global_offset
from shardwise._compat import StridedShard as _StridedShard
from shardwise.sharded_tensor import ShardedTensor

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


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


def dtype_of(value: Any) -> torch.dtype:
    return value.dtype


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
    shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                           value.placements)
    local = value._local_tensor
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"{key}: the DTensor's local tensor has shape {tuple(local.shape)}, "
                         f"its placements give {tuple(shape)}")
    return LocalChunk(tuple(int(o) for o in offsets), local)


def numel(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they do not overlap (or it is empty)."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def check_cover(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise ValueError unless ``boxes`` lie inside ``shape`` and tile the whole tensor without
    overlapping (no gap, no element twice)."""
    for box in boxes:
        if len(box[0]) != len(shape) or len(box[1]) != len(shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(box[0], box[1], shape)):
            raise ValueError(f"{name}: the chunk {box} lies outside the tensor's global shape "
                             f"{tuple(shape)}")
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if numel(a[1]) and numel(b[1]) and intersect(a, b) is not None:
                raise ValueError(f"{name}: ranks hold overlapping but different chunks {a} and "
                                 f"{b}; the checkpoint cannot tell which one to keep")
    covered = sum(numel(b[1]) for b in boxes)
    if covered != numel(shape):
        raise ValueError(f"{name}: the ranks' chunks cover {covered} of the {numel(shape)} "
                         f"elements of its global shape {tuple(shape)}")


def rows_and_row_numel(sizes: Sequence[int]) -> tuple[int, int]:
    """A chunk seen as rows along dim 0 (a 0-dim tensor is one row of one element)."""
    if len(sizes) == 0:
        return 1, 1
    return int(sizes[0]), numel(sizes[1:])
