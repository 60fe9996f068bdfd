"""Library functions that start processes of their own work when the caller is itself a rank
of ``shardwise run``: the launcher (``shardwise.launch.launch``, a job inside a job) and the RPC
benchmark (``shardwise bench rpc``, whose worker pairs host their own store although they
inherit the launcher's TORCHELASTIC_USE_AGENT_STORE). Before the benchmark's fix its pairs
waited on a store that nobody hosted."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.examples.test_run_examples import TIMEOUT, _env
from tests.harness import procs

pytestmark = pytest.mark.examples

INNER = """
import torch
import torch.distributed as dist
from shardwise.distributed import init
init()
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"inner rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item():g}")
"""

OUTER = """
import sys
from shardwise.launch import launch
status = launch(2, [sys.executable, sys.argv[1]])
print(f"outer: inner job exited {status}")
sys.exit(status)
"""


def test_a_launched_rank_launches_a_job_of_its_own(tmp_path):
    (tmp_path / "inner.py").write_text(textwrap.dedent(INNER))
    (tmp_path / "outer.py").write_text(textwrap.dedent(OUTER))
    done = procs.run(["-m", "shardwise", "run", "--nproc", "1", "outer.py",
                      str(tmp_path / "inner.py")], _env(), tmp_path, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):  # the inner job's own ranks, not the outer's
        assert f"inner rank {rank} of 2: sum 3" in done.stdout, done.stdout
    assert "outer: inner job exited 0" in done.stdout


def test_the_rpc_benchmark_runs_as_a_launched_rank(tmp_path):
    env = _env()
    env["SHARDWISE_TIMEOUT"] = "120"  # a pair that waits for a store fails within this
    done = procs.run(["-m", "shardwise", "run", "--nproc", "1", "-m", "shardwise", "bench",
                      "rpc", "--rounds", "1", "--echo", "20", "--big", "1", "--big-mb", "1",
                      "--inflight", "20", "--impls", "shardwise-tcp,torch",
                      "--out", str(tmp_path)], env, tmp_path, timeout=TIMEOUT)
    assert done.returncode == 0, f"{sys.executable} -m shardwise bench rpc\n{done.stdout}\n" \
                                 f"{done.stderr}"
    assert list(tmp_path.glob("*.json")), f"no record written: {sorted(tmp_path.iterdir())}"
