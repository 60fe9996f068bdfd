"""Sharding specs: how a tensor is cut into shards and where each shard goes (pure values).

``ChunkShardingSpec(dim, placements)`` cuts ``dim`` into ``len(placements)`` chunks as
``torch.chunk`` does (uneven last chunk, empty trailing chunks) and puts chunk ``i`` on
``placements[i]``. ``EnumerableShardingSpec(shards)`` lists every shard's box and placement and is
validated once the tensor size is known (no overlap, full coverage, ranks inside the group).
Placements name global ranks ([Note: global ranks in placements], metadata.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from shardwise.distributed.groups import backend_device
from shardwise.sharded_tensor.metadata import (
    Placement,
    ShardingError,
    ShardMetadata,
    chunk_offsets,
    chunk_sizes,
    parse_placement,
    to_group_ranks,
    validate_shards,
)


class ShardingSpec(ABC):
    @abstractmethod
    def build_metadata(self, size: Sequence[int], world_size: int | None = None
                       ) -> list[ShardMetadata]:
        """Every shard's box for a tensor of ``size``, placements as given (global ranks);
        with ``world_size``, checked against a group of the global ranks 0..world_size-1."""

    def group_metadata(self, size: Sequence[int], group_ranks: Sequence[int]
                       ) -> list[ShardMetadata]:
        """The shards for ``size`` placed on ranks *of the group* whose global ranks are
        ``group_ranks`` (torch's error for a placement outside it)."""
        shards = self.build_metadata(size)
        local = to_group_ranks(shards, group_ranks, repr(self))
        validate_shards(local, size, len(group_ranks))
        return local

    @abstractmethod
    def placements_list(self) -> list[Placement]:
        """The placement of every shard, in shard order."""


class ChunkShardingSpec(ShardingSpec):
    """Chunks ``dim`` over ``placements`` (``"rank:0/cpu"`` strings, ints or Placements)."""

    def __init__(self, dim: int, placements: Sequence[str | int | Placement]):
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ShardingError(f"ChunkShardingSpec: dim must be an int, got {dim!r}")
        if not placements:
            raise ShardingError("ChunkShardingSpec: placements is empty; give one per chunk")
        self.dim = dim
        self.placements = [parse_placement(p) for p in placements]
        ranks = [p.rank for p in self.placements]
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        if dup:
            raise ShardingError(f"ChunkShardingSpec: ranks {dup} appear more than once in "
                                f"placements {[str(p) for p in self.placements]}")

    def placements_list(self) -> list[Placement]:
        return list(self.placements)

    def sharded_dim(self, ndim: int) -> int:
        if not -ndim <= self.dim < ndim:
            raise ShardingError(f"ChunkShardingSpec(dim={self.dim}) does not fit a tensor of "
                                f"{ndim} dimensions")
        return self.dim % ndim

    def build_metadata(self, size: Sequence[int], world_size: int | None = None
                       ) -> list[ShardMetadata]:
        size = tuple(size)
        dim = self.sharded_dim(len(size))
        if world_size is not None:
            to_group_ranks([ShardMetadata((0,), (0,), p) for p in self.placements],
                           range(world_size), repr(self))
        n = len(self.placements)
        shards = []
        for place, off, length in zip(self.placements, chunk_offsets(size[dim], n),
                                      chunk_sizes(size[dim], n)):
            offsets = tuple(off if d == dim else 0 for d in range(len(size)))
            sizes = tuple(length if d == dim else s for d, s in enumerate(size))
            shards.append(ShardMetadata(offsets, sizes, place))
        return shards

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ChunkShardingSpec) and self.dim == other.dim
                and self.placements == other.placements)

    def __hash__(self) -> int:
        return hash((self.dim, tuple(self.placements)))

    def __repr__(self) -> str:
        return f"ChunkShardingSpec(dim={self.dim}, placements={[str(p) for p in self.placements]})"


class EnumerableShardingSpec(ShardingSpec):
    """Every shard listed explicitly; checked for overlap, coverage and ranks when used."""

    def __init__(self, shards: Sequence[ShardMetadata]):
        if not shards:
            raise ShardingError("EnumerableShardingSpec: no shards given")
        self.shards = list(shards)
        if any(s.placement is None for s in self.shards):
            missing = [s.describe() for s in self.shards if s.placement is None]
            raise ShardingError(f"EnumerableShardingSpec: shards {missing} have no placement")
        ndims = {len(s.shard_sizes) for s in self.shards}
        if len(ndims) > 1:
            raise ShardingError(f"EnumerableShardingSpec: shards disagree on the number of "
                                f"dimensions ({sorted(ndims)})")

    def placements_list(self) -> list[Placement]:
        return [s.placement for s in self.shards]

    def build_metadata(self, size: Sequence[int], world_size: int | None = None
                       ) -> list[ShardMetadata]:
        if world_size is not None:
            to_group_ranks(self.shards, range(world_size), repr(self))
        validate_shards(self.shards, size)
        return list(self.shards)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnumerableShardingSpec) and self.shards == other.shards

    def __hash__(self) -> int:
        return hash(tuple(self.shards))

    def __repr__(self) -> str:
        return f"EnumerableShardingSpec([{', '.join(s.describe() for s in self.shards)}])"


def resolve_device(placement: Placement, backend: str) -> torch.device:
    """The device a shard with this placement lives on, given the group's backend."""
    if placement.device is not None:
        return placement.device
    return backend_device(backend)
