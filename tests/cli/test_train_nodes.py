"""`shardwise train --strategy hsdp` as two nodes on loopback: two launchers (`--nnodes 2
--node-rank 0/1 --rdzv-endpoint 127.0.0.1:PORT`, 2 ranks each) train with one replica per node
(the default) and log the same losses as one launcher running 4 ranks with `--replicas 2`; and
so does the same job under two torchrun agents (`torchrun --nnodes 2`, c10d rendezvous, the
agent's store)."""

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.ports import reserved_port

pytestmark = pytest.mark.slow  # minutes of launchers and restarts: `pytest -m slow`

TRAIN = ["train", "--strategy", "hsdp", "--n-layer", "1", "--n-head", "2", "--d-model", "32",
         "--seq-len", "16", "--batch-size", "8", "--steps", "3", "--warmup", "1",
         "--eval-batches", "1", "--log-every", "1", "--corpus-bytes", "100000", "--no-progress"]
LOSS = re.compile(r"step (\d+)/\d+ loss (\S+)")


@pytest.fixture
def port():
    """The rendezvous port, held for the test (tests/harness/ports.py): the launcher (or
    agent) that hosts the store binds it."""
    with reserved_port() as number:
        yield number


def _start(*argv, launcher=None):
    env = {**os.environ, "SHARDWISE_TIMEOUT": "60"}
    launcher = launcher or [sys.executable, "-m", "shardwise"]
    return subprocess.Popen([*launcher, *TRAIN, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@functools.lru_cache(maxsize=1)
def _one_node() -> tuple[str, dict[int, float]]:
    one = _start("--nproc", "4", "--replicas", "2")
    out, err = one.communicate(timeout=300)
    assert one.returncode == 0, err[-2000:]
    assert sorted(_losses(out)) == [1, 2, 3], out
    return out, _losses(out)


def _losses(out: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS.findall(out)}


def test_two_nodes_on_loopback_train_hsdp_like_one_node_with_four_ranks(port):
    nodes = [_start("--nproc", "2", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint",
                    f"127.0.0.1:{port}") for k in (0, 1)]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    out, one_node = _one_node()
    for printed in (outs[0][0], out):  # one replica per node by default
        assert "hsdp: mesh replicate 2 x shard 2" in printed, printed
    assert _losses(outs[0][0]) == one_node
    assert _losses(outs[1][0]) == {}  # rank 0 (on node 0) logs


TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")
def test_the_same_job_under_two_torchrun_agents(port):
    agents = [_start(launcher=[
        TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shardwise-test", "-m",
        "shardwise"]) for _ in (0, 1)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-2000:] for o in outs]
    logged = [_losses(o[0]) for o in outs if _losses(o[0])]  # c10d picks which agent is node 0
    assert logged == [_one_node()[1]], logged
