"""Rank 1 stops itself with SIGSTOP (no heartbeat, no collective pending): the watchdog names it."""

import os
import signal
import time

import torch.distributed as dist

from shardwise.distributed import init

init("gloo")
if dist.get_rank() == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(120)
