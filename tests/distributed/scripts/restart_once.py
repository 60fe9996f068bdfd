"""Rank 1 fails on the first attempt only; every attempt prints its restart count."""

import os

import torch
import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} rank {dist.get_rank()}", flush=True)
if attempt == 0 and dist.get_rank() == 1:
    raise RuntimeError("first attempt fails on purpose")
t = torch.ones(1)
dist.all_reduce(t, group=group)
print(f"attempt {attempt} total={int(t.item())}", flush=True)
