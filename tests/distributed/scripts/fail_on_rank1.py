"""Rank 1 raises; rank 0 waits in a barrier with a long timeout: the launcher must stop it."""

import torch
import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo", timeout=600)
print(f"hello from rank {dist.get_rank()}", flush=True)
if dist.get_rank() == 1:
    raise ValueError("rank one broke on purpose")
dist.barrier(group=group)
torch.zeros(1)
