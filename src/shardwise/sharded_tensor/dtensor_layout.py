"""A ShardedTensor's layout as DTensor placements, where the two describe the same layout.

A parameter sharded by ``shard_module`` with a ``ChunkShardingSpec(d, ...)`` whose chunk ``i``
lies on rank ``i`` of its group is split exactly as a DTensor with placement ``Shard(d)`` on a
1D mesh over that group (both follow ``torch.chunk``). ``dtensor_placements`` gives that
placement (or says why there is none), so a mechanism that works on DTensors (FSDP over a
tensor-parallel model) takes our TP shards and torch's alike.
"""

from __future__ import annotations

import torch.distributed as dist

from shardwise._compat import Placement, Shard
from shardwise.distributed.groups import global_ranks
from shardwise.sharded_tensor.metadata import ShardingError
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor
from shardwise.sharded_tensor.spec import ChunkShardingSpec


def dtensor_placements(st: ShardedTensor, name: str = "the tensor") -> tuple[Placement, ...]:
    """``(Shard(d),)``: the placement on a 1D mesh over ``st.process_group`` that holds every
    rank's shard of ``st`` exactly. Raises ShardingError for a layout DTensor cannot express
    (enumerable shards, or chunks placed out of rank order). No collective."""
    spec = st.sharding_spec()
    world = dist.get_world_size(st.process_group)
    ranks = ([p.rank for p in spec.placements_list()]
             if isinstance(spec, ChunkShardingSpec) else None)
    # chunk i on rank i of the group, named by its group rank or by its global rank
    if ranks not in (list(range(world)), global_ranks(st.process_group)):
        raise ShardingError(f"{name} is sharded as {spec!r}; as a DTensor it needs a "
                            f"ChunkShardingSpec whose chunk i is on rank i of its group of "
                            f"{world} (0..{world - 1})")
    return (Shard(spec.sharded_dim(st.dim())),)
