"""The ZeRO optimizer keeps freed heap blocks resident ([Note: heap kept resident across steps]).

glibc's own counters (``mallinfo2``: bytes in blocks that have their own mmap) tell where a
block came from, so the check is deterministic: in a fresh process a 20 MiB block is mmap'd
(the dynamic rule is on, the threshold below it), freeing it raises the threshold to 20 MiB,
and a 28 MiB block would be mmap'd too, unless the optimizer moved the threshold to glibc's
maximum, in which case it comes from the heap.
"""

import os
import sys

import pytest

from tests.harness import procs

PROGRAM = """
import ctypes, sys
import torch
import torch.distributed as dist
from shardwise import ZeroRedundancyOptimizer

libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks "
                                                "fsmblks uordblks fordblks keepcost").split()]
libc.mallinfo2.restype = Info

def own_mmap(mib):
    before = libc.mallinfo2().hblkhd
    block = torch.empty(mib << 18)  # float32: mib MiB
    mapped = libc.mallinfo2().hblkhd - before >= mib << 20
    del block
    return mapped

assert own_mmap(20), "precondition: a fresh process mmaps a 20 MiB block"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ZeroRedundancyOptimizer(torch.nn.Linear(4, 4).parameters(), torch.optim.SGD, lr=0.1)
print("28 MiB own mmap after the optimizer:", own_mmap(28))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_zero_optimizer_serves_blocks_up_to_32_mib_from_the_heap():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = procs.run(["-c", PROGRAM], dict(env, OMP_NUM_THREADS="1"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "28 MiB own mmap after the optimizer: False" in done.stdout, done.stdout
