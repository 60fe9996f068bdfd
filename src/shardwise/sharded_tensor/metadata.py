"""Sharding metadata as pure values: placements, shard boxes, chunk math and validation.

Nothing here starts a process or touches a tensor's data: every function is unit-tested on its own.
A shard is a box of the global tensor (``shard_offsets`` + ``shard_sizes``) placed on one rank.

[Note: global ranks in placements]
As in torch's ``torch.distributed._shard``, the rank in a placement (``"rank:N/device"`` in a
``ChunkShardingSpec`` or ``EnumerableShardingSpec``, a ``ShardMetadata``'s placement, the rank of
``Shard.from_tensor_and_offsets``) is a *global* rank, which must belong to the process group the
tensor is sharded over (else torch's error, "Global rank N does not exist in input process
group"). A spec thus names processes, whatever group it is used on: on a tensor-parallel group
made of global ranks [2, 3], ``ChunkShardingSpec(0, ["rank:2", "rank:3"])`` puts chunk 0 on
process 2. When a ShardedTensor is made, its shards' metadata is translated once into ranks of
the group (``to_group_ranks``), which is what the collectives and the sharded ops use; specs
keep the global ranks they were given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class ShardingError(ValueError):
    """A sharding spec, its metadata or a set of shards is invalid; the message says how."""


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a region of a tensor


@dataclass(frozen=True)
class Placement:
    """Where a shard lives: a rank of the group and, optionally, a device on that rank.

    ``device`` None means "the rank's default device" (CPU under gloo, the current CUDA device
    under NCCL), resolved when the shard is created.
    """

    rank: int
    device: torch.device | None = None

    def __str__(self) -> str:
        return f"rank:{self.rank}" + (f"/{self.device}" if self.device is not None else "")


def parse_placement(value: str | int | Placement) -> Placement:
    """``"rank:0/cpu"``, ``"rank:1/cuda:1"``, ``"rank:2"``, an int rank, or a Placement."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ShardingError(f"placement {value!r}: expected 'rank:R/device', 'rank:R' or an int")
    if isinstance(value, int):
        if value < 0:
            raise ShardingError(f"placement {value}: a rank cannot be negative")
        return Placement(value)
    head, _, device = value.partition("/")
    kind, _, rank = head.partition(":")
    if kind != "rank" or not rank.isdigit():
        raise ShardingError(
            f"placement {value!r}: expected 'rank:R/device' (e.g. 'rank:0/cpu', 'rank:1/cuda:1')"
        )
    if device:
        try:
            return Placement(int(rank), torch.device(device))
        except RuntimeError as err:
            raise ShardingError(f"placement {value!r}: bad device {device!r} ({err})") from None
    return Placement(int(rank))


@dataclass(frozen=True)
class ShardMetadata:
    """One shard: its offsets and sizes in the global tensor and where it lives.

    Same fields as ``torch.distributed._shard.metadata.ShardMetadata``; ``placement`` accepts a
    string such as ``"rank:0/cpu"`` and is stored parsed.
    """

    shard_offsets: tuple[int, ...]
    shard_sizes: tuple[int, ...]
    placement: Placement | None = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_offsets", tuple(int(o) for o in self.shard_offsets))
        object.__setattr__(self, "shard_sizes", tuple(int(s) for s in self.shard_sizes))
        if self.placement is not None:
            object.__setattr__(self, "placement", parse_placement(self.placement))
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ShardingError(
                f"shard offsets {self.shard_offsets} and sizes {self.shard_sizes} have different "
                "numbers of dimensions"
            )
        if any(o < 0 for o in self.shard_offsets) or any(s < 0 for s in self.shard_sizes):
            raise ShardingError(f"shard {self.describe()}: offsets and sizes must be >= 0")

    @property
    def rank(self) -> int:
        if self.placement is None:
            raise ShardingError(f"shard {self.describe()} has no placement")
        return self.placement.rank

    @property
    def numel(self) -> int:
        return math.prod(self.shard_sizes)

    def describe(self) -> str:
        box = ", ".join(f"{o}:{o + s}" for o, s in zip(self.shard_offsets, self.shard_sizes))
        return f"[{box}] on {self.placement}"

    @property
    def box(self) -> Box:
        """``(shard_offsets, shard_sizes)``."""
        return self.shard_offsets, self.shard_sizes

    def region(self) -> tuple[slice, ...]:
        """The index of this shard's box in the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.shard_offsets, self.shard_sizes))


def split_size(dim_size: int, chunks: int) -> int:
    """Rows per chunk when ``dim_size`` rows are cut into ``chunks`` pieces, as torch.chunk does."""
    if chunks < 1:
        raise ShardingError(f"cannot split into {chunks} chunks")
    return -(-dim_size // chunks)


def chunk_sizes(dim_size: int, chunks: int) -> list[int]:
    """Sizes of the ``chunks`` pieces of a dimension of ``dim_size``, like ``torch.chunk``.

    Every piece but the trailing ones holds ``ceil(dim_size / chunks)``; the last non-empty one
    holds what is left, and pieces past the end are empty (torch.chunk returns fewer chunks; a
    sharding still gives those ranks a shard, of size 0). ``chunk_sizes(5, 4) == [2, 2, 1, 0]``.
    """
    step = split_size(dim_size, chunks)
    return [max(0, min(dim_size, step * (i + 1)) - step * i) for i in range(chunks)]


def chunk_offsets(dim_size: int, chunks: int) -> list[int]:
    step = split_size(dim_size, chunks)
    return [min(dim_size, step * i) for i in range(chunks)]


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def overlap(a: ShardMetadata, b: ShardMetadata) -> Box | None:
    """The box two shards share, as (offsets, sizes), or None when they share no element."""
    return intersect(a.box, b.box)


@dataclass(frozen=True)
class TilingFault:
    """Why boxes do not tile a tensor: ``"dims"`` (box ``first`` has another number of dims),
    ``"outside"`` (box ``first`` reaches outside, or has a negative offset or size),
    ``"overlap"`` (boxes ``first`` and ``second`` share elements) or ``"coverage"`` (the boxes
    hold ``covered`` of the ``total`` elements)."""

    kind: str
    first: int = -1
    second: int = -1
    covered: int = 0
    total: int = 0


def tiling_fault(shape: Sequence[int], boxes: Sequence[Box]) -> TilingFault | None:
    """None when ``boxes`` lie inside ``shape`` and tile it exactly (no gap, no element twice);
    else the first fault found, for the caller to put in its own words. Pure."""
    for i, (offsets, sizes) in enumerate(boxes):
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return TilingFault("dims", i)
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return TilingFault("outside", i)
    pair = _first_overlap(boxes)
    if pair is not None:
        return TilingFault("overlap", *pair)
    covered, total = sum(math.prod(b[1]) for b in boxes), math.prod(shape)
    if covered != total:
        return TilingFault("coverage", covered=covered, total=total)
    return None


def _first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Two boxes that share an element (lower index first), or None. A sweep along dim 0: the
    boxes in order of their first row, each compared only with the earlier boxes whose rows it
    reaches, so a tiling of K row bands (FSDP, ZeRO, a ShardedTensor on dim 0) costs
    O(K log K) instead of the K^2 / 2 pairs, and K bands x C columns O(K C log K C). Empty
    boxes share nothing."""
    scalars = [i for i, b in enumerate(boxes) if not b[1]]  # 0-dim: one element each
    if len(scalars) > 1:
        return scalars[0], scalars[1]
    order = sorted((b[0][0], i) for i, b in enumerate(boxes)
                   if b[1] and all(n > 0 for n in b[1]))
    active: list[tuple[int, int]] = []  # (end row, index) of boxes still open
    for start, i in order:
        active = [(end, j) for end, j in active if end > start]
        for _, j in active:
            if intersect(boxes[i], boxes[j]) is not None:
                return min(i, j), max(i, j)
        active.append((start + boxes[i][1][0], i))
    return None


def validate_shards(shards: Sequence[ShardMetadata], size: Sequence[int],
                    world_size: int | None = None) -> None:
    """Shards must lie inside ``size``, not overlap, cover every element, and (given
    ``world_size``) sit on ranks 0..world_size-1 (ranks of the group, after ``to_group_ranks``);
    the error names the offending shards or ranks."""
    size = tuple(size)
    fault = tiling_fault(size, [s.box for s in shards])
    if fault is not None and fault.kind in ("dims", "outside"):
        s = shards[fault.first]
        if fault.kind == "dims":
            raise ShardingError(f"shard {s.describe()} has {len(s.shard_sizes)} dims, the tensor "
                                f"{tuple(size)} has {len(size)}")
        raise ShardingError(f"shard {s.describe()} reaches outside the tensor {size}")
    for s in shards:
        if world_size is not None and s.placement is not None and s.rank >= world_size:
            raise ShardingError(f"shard {s.describe()} is placed on rank {s.rank}, outside the "
                                f"group of {world_size} ranks (0..{world_size - 1})")
    if fault is not None and fault.kind == "overlap":
        a, b = shards[fault.first], shards[fault.second]
        raise ShardingError(f"shards {a.describe()} and {b.describe()} overlap")
    if fault is not None:
        raise ShardingError(f"shards cover {fault.covered} of the {fault.total} elements of a "
                            f"tensor of size {size}: pieces are missing")


def check_ranks(placements: Sequence[Placement], group_ranks: Sequence[int], what: str) -> None:
    """Every placement names a global rank of the group (``group_ranks``: its global ranks in
    group order); torch's error otherwise. See [Note: global ranks in placements]."""
    bad = sorted({p.rank for p in placements if p.rank not in group_ranks})
    if bad:
        raise ShardingError(f"{what}: Global rank {bad[0]} does not exist in input process "
                            f"group (placements name global ranks, as in torch; the group's "
                            f"global ranks are {list(group_ranks)}; ranks {bad} are outside it)")


def to_group_ranks(shards: Sequence[ShardMetadata], group_ranks: Sequence[int], what: str
                   ) -> list[ShardMetadata]:
    """The shards with each placement's global rank replaced by its rank within the group
    (checked: torch's error for a rank outside the group)."""
    check_ranks([s.placement for s in shards], group_ranks, what)
    index = {g: i for i, g in enumerate(group_ranks)}
    return [ShardMetadata(s.shard_offsets, s.shard_sizes,
                          Placement(index[s.rank], s.placement.device)) for s in shards]


@dataclass(frozen=True)
class TensorProperties:
    dtype: torch.dtype = torch.float32
    requires_grad: bool = False


@dataclass(frozen=True)
class ShardedTensorMetadata:
    """The global view of a sharded tensor: every shard's box and placement, and the size."""

    shards_metadata: tuple[ShardMetadata, ...]
    size: torch.Size
    tensor_properties: TensorProperties = TensorProperties()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards_metadata", tuple(self.shards_metadata))
        object.__setattr__(self, "size", torch.Size(self.size))

    def on_rank(self, rank: int) -> list[ShardMetadata]:
        return [s for s in self.shards_metadata if s.rank == rank]

    def same_layout(self, other: ShardedTensorMetadata) -> bool:
        return self.size == other.size and self.shards_metadata == other.shards_metadata
