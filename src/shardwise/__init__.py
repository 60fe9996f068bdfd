"""shardwise: PyTorch's distributed training toolkit, faster and clearer.

The public API. Mechanisms live in subpackages; this module only names them.
"""

from shardwise import distributed
from shardwise.ddp import DistributedDataParallel
from shardwise.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, fully_shard

__version__ = "0.1.0"

__all__ = [
    "CPUOffload",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "distributed",
    "fully_shard",
]
