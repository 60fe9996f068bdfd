"""Rank 0 plays a process without the job's secret: from a thread with its own store client it
writes, every millisecond, a frozen progress record over rank 1's (plain JSON, and a signed-looking
one with a wrong MAC) and a failure report of a node; meanwhile both ranks are healthy for
ARGV[1] seconds, then meet in a barrier and exit 0."""

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo", timeout=60)
seconds = float(sys.argv[1])


def forge() -> None:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=10))
    frozen = json.dumps({"seq": 0, "beats": 0, "t": 1.0, "n": 10**9, "pid": 1,
                         "exiting": False})
    fakes = [frozen.encode(), b"SWS1" + bytes(32) + frozen.encode()]
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        store.set("shardwise/progress/attempt_0/rank_1", fakes[i % 2])
        i += 1
        time.sleep(0.001)


thread = threading.Thread(target=forge, daemon=True)
if dist.get_rank() == 0:
    thread.start()
time.sleep(seconds)
if thread.is_alive():
    thread.join()
dist.barrier(group=group)
print(f"rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
