"""Prints the launch variables torchrun would set, then all-reduces the ranks' sum."""

import os

import torch
import torch.distributed as dist

from shardwise.distributed import destroy, init

names = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE")
print("env " + " ".join(f"{n}={os.environ[n]}" for n in names), flush=True)
group = init("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t, group=group)
print(f"sum={int(t.item())}", flush=True)
destroy()
