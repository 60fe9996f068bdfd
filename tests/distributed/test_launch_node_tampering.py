"""A process that knows only the rendezvous store's port (no secret) tampers with a healthy
two-node job (two launchers on 127.0.0.1): no node is blamed and the job finishes. Whether
another node's launcher is alive comes over the authenticated launcher-to-launcher connection
(launch/node_link.py), which no other process can write into or delete; before it, deleting
node 1's beat record, or writing one old copy of it back, got node 1 declared lost."""

import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.harness.pace import CAP_S, Yardstick
from tests.harness.ports import reserved_port

pytestmark = pytest.mark.slow  # two-node jobs of up to two timeouts: `pytest -m slow`

SCRIPTS = Path(__file__).parent / "scripts"


def _timeout():
    """The launchers' timeout (SHARDWISE_TIMEOUT: how long a silent node takes to be declared
    lost), scaled to the machine now ([Note: waits scaled to the machine], tests/harness/pace.py):
    node 1's launcher starts and joins within it at any load. The job lives two of them: a
    frozen or missing beat record outlives the timeout."""
    yardstick = Yardstick()
    try:
        while yardstick.bound() is None:
            assert yardstick.elapsed() < CAP_S, "a fresh interpreter did not import torch"
            time.sleep(0.05)
        return math.ceil(yardstick.bound())
    finally:
        yardstick.stop()


def _node(port, node_rank, script, *args, env=None):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", "1", "--nnodes", "2",
           "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--grace-seconds", "3", str(SCRIPTS / script), *map(str, args)]
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


@pytest.mark.parametrize("mode", ["delete", "replay"])
def test_an_outsider_rewriting_node_beats_gets_no_node_declared_lost(mode):
    timeout = _timeout()
    with reserved_port() as port:
        nodes = [_node(port, k, "store_tamperer.py", mode, 2 * timeout, "shardwise/node_beat/1",
                       env={"SHARDWISE_TIMEOUT": str(timeout)}) for k in (0, 1)]
        outs = [n.communicate(timeout=2 * timeout + 600) for n in nodes]
    text = "\n".join(o + e for o, e in outs)
    assert "lost" not in text, text[-3000:]
    assert [n.returncode for n in nodes] == [0, 0], text[-3000:]
    assert "rank 0 done" in text and "rank 1 done" in text


# -- records copied from another job with the same secret -------------------------------------

# the same secret in both jobs, as users set it; a timeout well beyond the 3 s by which node
# 1's ranks outlive node 0's (nothing here should time out)
FOREIGN_ENV = {"SHARDWISE_RPC_SECRET": "ab" * 32, "SHARDWISE_TIMEOUT": "60"}


@pytest.mark.parametrize("kind", ["failed", "job_stopped", "finished", "node_lost"])
def test_launcher_records_copied_from_another_job_change_nothing(kind):
    # "finished": node 1's rank outlives node 0's by 3 s, so a node 0 that believed the copy
    # would leave (and take the store) while node 1 still runs, and node 1's rank would find
    # the store gone. "node_lost": a second launcher for node 1, started while the job runs
    # (which lasts until the second launcher is done), must not take node 1's place with the
    # copied mark
    lifetime = "until-told" if kind == "node_lost" else 8
    with reserved_port() as port:
        nodes = [_node(port, k, "foreign_records.py", kind, lifetime, 3, env=FOREIGN_ENV)
                 for k in (0, 1)]
        for line in nodes[1].stdout:  # node 1's rank runs
            if "pid" in line:
                break
        if kind == "node_lost":
            second = _node(port, 1, "foreign_records.py", kind, 0, 0, env=FOREIGN_ENV)
            _, err = second.communicate(timeout=600)
            dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=timedelta(seconds=60)).set("test/told", "1")
            assert second.returncode == 2, err
            assert ("two launchers were started with --node-rank 1: the first is still "
                    "running") in err
        outs = [n.communicate(timeout=600) for n in nodes]
    text = "\n".join(o + e for o, e in outs)
    assert [n.returncode for n in nodes] == [0, 0], text[-3000:]
    assert "another job's error" not in text and "received SIGTERM" not in text
    assert "the store was gone" not in text
    assert "rank 0 done" in text and "rank 1 done" in text
