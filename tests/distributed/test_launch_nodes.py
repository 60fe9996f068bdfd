"""Two launchers on one machine over loopback behave as two nodes (torchrun's --nnodes,
--node-rank, --rdzv-endpoint); disagreements are clear errors; a lost node is named."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
SHORT = "3"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port, node_rank, nnodes, script, *extra, nnodes_flag=None):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", "2", "--nnodes",
           str(nnodes_flag or nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--grace-seconds", "3", *extra, str(SCRIPTS / script)]
    env = {**os.environ, "SHARDWISE_TIMEOUT": SHORT}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_two_launchers_form_one_job_with_torchruns_variables():
    port = _free_port()
    nodes = [_node(port, k, 2, "node_env.py") for k in (0, 1)]
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1] for o in outs]
    for k, (out, _) in enumerate(outs):
        for local in range(2):
            rank = 2 * k + local
            assert (f"[rank{rank}]: env RANK={rank} LOCAL_RANK={local} LOCAL_WORLD_SIZE=2 "
                    f"GROUP_RANK={k} WORLD_SIZE=4") in out, out
            assert f"[rank{rank}]: sum=6" in out  # 0+1+2+3: one group of four ranks


def test_node_rank_out_of_range_is_an_error():
    done = subprocess.run([sys.executable, "-m", "shardwise", "run", "--nnodes", "2",
                           "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1",
                           str(SCRIPTS / "node_env.py")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--node-rank must be in [0, 2) for --nnodes 2, got 2" in done.stderr


def test_launchers_that_disagree_on_nnodes_both_stop_with_a_clear_error():
    port = _free_port()
    first = _node(port, 0, 2, "node_env.py")
    time.sleep(1.0)  # node 0 hosts the store
    second = _node(port, 1, 3, "node_env.py")
    errs = [p.communicate(timeout=60)[1] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [2, 2], errs
    assert "the launchers disagree on --nnodes: node 0 has 2, node 1 has 3" in errs[0]
    assert "the launchers disagree on --nnodes: node 1 has 3, node 0 has 2" in errs[1]


def test_a_lost_node_stops_the_others_with_an_error_naming_it():
    port = _free_port()
    nodes = [_node(port, k, 2, "forever.py") for k in (0, 1)]
    seen = 0
    for line in nodes[0].stdout:  # wait until the job runs: node 0's ranks said hello
        seen += "pid " in line
        if seen == 2:
            break
    nodes[1].send_signal(signal.SIGKILL)
    _, err = nodes[0].communicate(timeout=60)
    assert nodes[0].returncode == 1, err
    assert re.search(r"node\(s\) 1 lost: no word from their launcher for more than 3 s", err), err
    nodes[1].wait()
