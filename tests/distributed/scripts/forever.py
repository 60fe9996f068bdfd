"""Every rank prints its pid, then all-reduces forever: only a signal ends it.

``--abort-on-error``: a collective that fails aborts the process (SIGABRT, no Python error), as
a rank does whose native code (gloo, the store's client) gives up when a peer goes away."""

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
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        if "--abort-on-error" in sys.argv:
            os.abort()
        raise
    time.sleep(0.05)
