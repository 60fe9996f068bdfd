"""Every rank prints its pid, then all-reduces forever: only a signal ends it."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"pid {dist.get_rank()} {os.getpid()}", flush=True)
ignore = "--ignore-term" in sys.argv
if ignore:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
