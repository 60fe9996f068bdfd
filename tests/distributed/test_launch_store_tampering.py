"""A process that knows only the rendezvous store's port (no secret) deletes or replays a
healthy rank's progress records for the job's whole life: the launcher never blames that rank.
The watchdog's evidence comes over each rank's own pipe to its launcher, which no other process
can write or delete ([Note: progress records], launch/progress.py). The job lives for four
watchdog timeouts; before the pipe, the launcher stopped it as "no heartbeat"."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "store_tamperer.py"
TIMEOUT_S = 4  # the watchdog's patience (SHARDWISE_TIMEOUT); the job lives 4 of them


@pytest.mark.slow  # the job must outlive the watchdog's patience 4 times: ~22 s each
@pytest.mark.parametrize("mode", ["delete", "replay"])
def test_an_outsider_rewriting_progress_records_gets_no_rank_blamed(mode):
    env = {**os.environ, "SHARDWISE_TIMEOUT": str(TIMEOUT_S)}
    done = subprocess.run(
        [sys.executable, "-m", "shardwise", "run", "--nproc", "2", str(SCRIPT), mode,
         str(4 * TIMEOUT_S)], capture_output=True, text=True, env=env, timeout=300)
    out = done.stdout + done.stderr
    assert "stopped making progress" not in out, out[-3000:]
    assert done.returncode == 0, out[-3000:]
    assert "rank 0 done" in out and "rank 1 done" in out
