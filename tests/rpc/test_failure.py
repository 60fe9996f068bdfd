"""A worker that dies: pending calls fail fast and clearly, shutdown does not hang."""

from __future__ import annotations

import os

import pytest

from tests.harness import procs
from tests.rpc.conftest import ROOT, python_path


@pytest.mark.fresh
def test_dead_worker_fails_pending_calls_and_shutdown_names_it():
    # `python -m tests.rpc.failure_scenario`, started by tests/harness/procs.py
    program = procs.start(["-m", "tests.rpc.failure_scenario"], dict(
        os.environ, PYTHONPATH=python_path(), OMP_NUM_THREADS="1"), ROOT, merge_stderr=False)
    try:
        stdout, stderr = program.communicate(timeout=90)
    finally:
        program.kill()
    assert program.returncode == 0, stdout + stderr
    lines = stdout.splitlines()
    # WorkerDied, not TimeoutError: the call failed when the connection went, before its 30 s
    pending = next(line for line in lines if line.startswith("pending:"))
    assert pending.startswith("pending: WorkerDied") and "'victim' (rank 1) died" in pending
    assert "after: WorkerDied" in lines
    # graceful shutdown has no time limit, yet does not wait for the dead: it names it
    assert ("shutdown: WorkerDied: shutdown on 'survivor': worker 'victim' (rank 1) died "
            "before calling shutdown(); this worker has shut down") in lines
    assert "agent cleared: True" in lines
    assert "lost worker 'victim'" in stderr  # logged on the survivor
