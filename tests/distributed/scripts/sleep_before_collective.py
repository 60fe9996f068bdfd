"""Rank 1 sleeps before the all_reduce that rank 0 waits in (run with a short SHARDWISE_TIMEOUT):
rank 0 times out, and the launcher must name rank 1."""

import time

import torch
import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo")
if dist.get_rank() == 1:
    time.sleep(120)
dist.all_reduce(torch.ones(1), group=group)
