"""Every rank makes 10 steps of an all-reduce; rank ARGV[1] leaves with os._exit(0) at step 3
(no error, no failure record), so the others fail in their next all-reduce."""

import os
import sys

import torch
import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo", timeout=60)
for step in range(10):
    if step == 3 and dist.get_rank() == int(sys.argv[1]):
        os._exit(0)
    dist.all_reduce(torch.ones(1), group=group)
