"""DistributedDataParallel: replicated model, gradients all-reduced in buckets during backward."""

from shardwise.ddp.data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
