"""Rank 1 sleeps before the all_reduce that rank 0 waits in. The group's own timeout (the
rendezvous's too) stays long, so a slow start on a loaded machine is no failure; rank 0's wait
on the all_reduce alone has a short timeout (argv[1] seconds): it times out, and the launcher
must name rank 1."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo")
dist.barrier(group=group)  # both ranks are up: what follows is the subject
if dist.get_rank() == 1:
    time.sleep(120)
work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
work.wait(timeout=timedelta(seconds=float(sys.argv[1])))
