"""ZeRO stages 1 and 2: optimizer state (and, with ZeroDataParallel, gradients) sharded across
data-parallel ranks. See partition.py for who owns what, optimizer.py for stage 1, stage2.py for
stage 2, collectives.py for the communication."""

from shardwise.zero.optimizer import ZeroRedundancyOptimizer
from shardwise.zero.overlap import hook_with_zero_step, hook_with_zero_step_interleaved
from shardwise.zero.partition import partition_params
from shardwise.zero.stage2 import ZeroDataParallel

__all__ = ["ZeroDataParallel", "ZeroRedundancyOptimizer", "hook_with_zero_step",
           "hook_with_zero_step_interleaved", "partition_params"]
