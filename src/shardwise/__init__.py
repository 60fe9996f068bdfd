"""shardwise: PyTorch's distributed training toolkit, faster and clearer.

The public API. Mechanisms live in subpackages; this module only names them.
"""

from shardwise import distributed, rpc
from shardwise.ddp import DistributedDataParallel

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel",
    "distributed",
    "rpc",
]
