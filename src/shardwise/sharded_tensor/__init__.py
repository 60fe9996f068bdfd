"""Sharded tensors and tensor parallelism (``shardwise.sharded_tensor``).

Names and signatures follow ``torch.distributed._shard`` where they overlap: ShardMetadata,
ChunkShardingSpec, EnumerableShardingSpec, ShardedTensor, Shard, empty/zeros/ones/full/rand/randn,
init_from_local_shards, shard_tensor (torch's ``_shard_tensor``), shard_parameter, shard_module.
Importing the package registers the sharded ops (ops_*.py).
"""

from shardwise.sharded_tensor import ops_elementwise, ops_embedding, ops_linear, ops_reduction
from shardwise.sharded_tensor.creation import (
    empty,
    full,
    init_from_local_shards,
    ones,
    rand,
    randn,
    shard_tensor,
    zeros,
)
from shardwise.sharded_tensor.dispatch import UnsupportedShardedOp
from shardwise.sharded_tensor.metadata import (
    Placement,
    ShardedTensorMetadata,
    ShardingError,
    ShardMetadata,
)
from shardwise.sharded_tensor.parametrize import shard_module, shard_parameter, sharded_parameters
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor
from shardwise.sharded_tensor.spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

del ops_elementwise, ops_embedding, ops_linear, ops_reduction

__all__ = [
    "ChunkShardingSpec",
    "EnumerableShardingSpec",
    "Placement",
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "ShardingError",
    "ShardingSpec",
    "UnsupportedShardedOp",
    "empty",
    "full",
    "init_from_local_shards",
    "ones",
    "rand",
    "randn",
    "shard_module",
    "shard_parameter",
    "shard_tensor",
    "sharded_parameters",
    "zeros",
]
