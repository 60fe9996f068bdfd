"""DistributedDataParallel: replicated model, gradients all-reduced in buckets during backward."""

from shardwise.ddp import hooks
from shardwise.ddp.data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel", "hooks"]
