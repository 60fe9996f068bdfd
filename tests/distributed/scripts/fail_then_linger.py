"""Rank 1 raises, then lingers 1 s after closing its connections: rank 0 fails ("Connection
closed by peer") and exits first, so the exit order points at the wrong rank."""

import atexit
import time

import torch.distributed as dist

atexit.register(time.sleep, 1.0)  # registered before init's teardown, so it runs after it

from shardwise.distributed import init  # noqa: E402

group = init("gloo", timeout=600)
if dist.get_rank() == 1:
    raise ValueError("rank one broke on purpose")
dist.barrier(group=group)
