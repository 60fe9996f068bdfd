"""Every rank prints its pid; then rank ARGV[1] dies at once (ARGV[2]: 'kill' = SIGKILL to
itself, 'abort' = os.abort(), as a crash in native code, 'exit3' = os._exit(3)) while the others
wait in a barrier."""

import os
import signal
import sys

import torch.distributed as dist

from shardwise.distributed import init

group = init("gloo", timeout=600)
print(f"pid {dist.get_rank()} {os.getpid()}", flush=True)
dist.barrier(group=group)  # every pid is printed before anyone dies
if dist.get_rank() == int(sys.argv[1]):
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] == "abort":
        os.abort()
    os._exit(3)
dist.barrier(group=group)
