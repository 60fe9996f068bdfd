"""Rank 1 prints a progress line, then is killed by SIGKILL; rank 0 waits in a barrier."""

import os
import signal

import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo", timeout=600)
if dist.get_rank() == 1:
    print("step 7/10 loss=1.23", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier(group=group)
