"""Rank 0 finishes at once (exit 0); rank 1 hangs in a sleep: the watchdog must stop and name it."""

import time

import torch.distributed as dist

from shardwise.distributed import init

init("gloo")
if dist.get_rank() == 1:
    time.sleep(120)
print(f"rank {dist.get_rank()} done", flush=True)
