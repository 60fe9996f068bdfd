"""What the sharded ops need to know about a tensor's layout across the ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shardwise.sharded_tensor.dispatch import unsupported
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor
from shardwise.sharded_tensor.spec import ChunkShardingSpec


def chunk_dim(func: Callable, st: ShardedTensor, args: Any) -> int:
    """The dim ``st`` is chunked on, provided it is a ChunkShardingSpec placing exactly one
    chunk on every rank of its group (what the tensor-parallel ops assume)."""
    spec = st.sharding_spec()
    if not isinstance(spec, ChunkShardingSpec):
        raise unsupported(func, args, "only ChunkShardingSpec is supported here")
    world = dist.get_world_size(st.process_group)
    # the metadata's ranks are ranks of the group ([Note: global ranks in placements])
    ranks = sorted(m.rank for m in st.metadata().shards_metadata)
    if ranks != list(range(world)):
        places = [p.rank for p in spec.placements]
        raise unsupported(func, args, f"the spec must place one chunk on each of the {world} "
                          f"ranks of the group, it places chunks on global ranks {places}")
    return spec.sharded_dim(st.dim())


def rank_chunks(st: ShardedTensor, dim: int) -> tuple[list[int], list[int]]:
    """(offsets, sizes) along ``dim`` of the chunk each rank holds, indexed by rank."""
    world = dist.get_world_size(st.process_group)
    offsets, sizes = [0] * world, [0] * world
    for m in st.metadata().shards_metadata:
        offsets[m.rank], sizes[m.rank] = m.shard_offsets[dim], m.shard_sizes[dim]
    return offsets, sizes


def bind(args: tuple, kwargs: dict, names: tuple[str, ...], **defaults: Any) -> dict[str, Any]:
    """Positional-or-keyword arguments by name, as a Python signature would bind them."""
    out = {}
    for i, name in enumerate(names):
        if i < len(args):
            out[name] = args[i]
        else:
            out[name] = kwargs.get(name, defaults.get(name))
    return out
