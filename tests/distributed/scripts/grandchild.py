"""Each rank starts a child that ignores SIGTERM and writes that child's pid to
ARGV[1]/rank_<r>.pid; then ARGV[2] says how the rank ends: 'ok' (exit 0), 'fail' (rank 1
raises, rank 0 waits), 'wait' (sleep until stopped). No process group: no torch needed."""

import os
import subprocess
import sys
import time

rank = int(os.environ["RANK"])
child = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
     " print('ready', flush=True); time.sleep(3600)"], stdout=subprocess.PIPE)
assert child.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here on
path = os.path.join(sys.argv[1], f"rank_{rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(child.pid))
os.rename(path + ".tmp", path)
print(f"pid {rank} {os.getpid()}", flush=True)
if sys.argv[2] == "fail" and rank == 1:
    # not before rank 0's child exists: the job must end with both children to sweep, however
    # slowly rank 0 starts on a loaded machine
    other = os.path.join(sys.argv[1], "rank_0.pid")
    deadline = time.monotonic() + 60
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("rank one broke on purpose")
if sys.argv[2] in ("fail", "wait"):
    time.sleep(3600)
