"""A worker that dies: pending calls fail fast and clearly, shutdown does not hang."""

from __future__ import annotations

import subprocess
import sys

from tests.rpc.conftest import ROOT


def test_dead_worker_fails_pending_calls_and_shutdown_names_it():
    out = subprocess.run([sys.executable, "-m", "tests.rpc.failure_scenario"], cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # WorkerDied, not TimeoutError: the call failed when the connection went, before its 30 s
    pending = next(line for line in lines if line.startswith("pending:"))
    assert pending.startswith("pending: WorkerDied") and "'victim' (rank 1) died" in pending
    assert "after: WorkerDied" in lines
    # graceful shutdown has no time limit, yet does not wait for the dead: it names it
    assert ("shutdown: WorkerDied: shutdown on 'survivor': worker 'victim' (rank 1) died "
            "before calling shutdown(); this worker has shut down") in lines
    assert "agent cleared: True" in lines
    assert "lost worker 'victim'" in out.stderr  # logged on the survivor
