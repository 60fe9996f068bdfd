"""shardwise: PyTorch's distributed training toolkit, faster and clearer.

The public API. Mechanisms live in subpackages; this module only names them.
"""

from shardwise import _compat, distributed, rpc, sharded_tensor
from shardwise.ddp import DistributedDataParallel
from shardwise.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from shardwise.zero import ZeroDataParallel, ZeroRedundancyOptimizer

__version__ = "0.1.0"

_compat.warn_if_untested()  # once per process: a module body runs once

__all__ = [
    "CPUOffload",
    "CPUOffloadPolicy",
    "DistributedDataParallel",
    "FSDPModule",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ZeroDataParallel",
    "ZeroRedundancyOptimizer",
    "distributed",
    "fully_shard",
    "rpc",
    "sharded_tensor",
]
