"""Two launchers on one machine over loopback behave as two nodes (torchrun's --nnodes,
--node-rank, --rdzv-endpoint); disagreements are clear errors; a lost node is named."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli.test_train import TINY
from tests.harness import run_on_ranks
from tests.harness.ports import reserved_port, wait_listening

pytestmark = pytest.mark.slow  # minutes of launchers and restarts: `pytest -m slow`

SCRIPTS = Path(__file__).parent / "scripts"
SHORT = "5"  # seconds: how long a silent node takes to be declared lost


@pytest.fixture
def port():
    """The rendezvous port, held for the test (tests/harness/ports.py): node 0's launcher
    binds it."""
    with reserved_port() as number:
        yield number


def _node(port, node_rank, nnodes, script, *extra, nnodes_flag=None, timeout=SHORT, args=()):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", "2", "--nnodes",
           str(nnodes_flag or nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--grace-seconds", "3", *extra, str(SCRIPTS / script), *args]
    env = {**os.environ, "SHARDWISE_TIMEOUT": timeout}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_two_launchers_form_one_job_with_torchruns_variables(port):
    # a long timeout: nothing here should time out, even on a loaded machine
    nodes = [_node(port, k, 2, "node_env.py", timeout="30") for k in (0, 1)]
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
                          timeout=600)  # only stops a hang: an interpreter starts at any load
    assert done.returncode == 2
    assert "--node-rank must be in [0, 2) for --nnodes 2, got 2" in done.stderr


def test_launchers_that_disagree_on_nnodes_both_stop_with_a_clear_error(port):
    # a long timeout: the disagreement is found when node 1 joins, however late it starts
    first = _node(port, 0, 2, "node_env.py", timeout="600")
    wait_listening(port, timeout=600)  # node 0 hosts the store: it is up before node 1 starts
    second = _node(port, 1, 3, "node_env.py", timeout="600")
    errs = [p.communicate(timeout=600)[1] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [2, 2], errs
    assert "the launchers disagree on --nnodes: node 0 has 2, node 1 has 3" in errs[0]
    assert "the launchers disagree on --nnodes: node 1 has 3, node 0 has 2" in errs[1]


def _wait_for_pids(proc, count):
    seen = 0
    for line in proc.stdout:  # wait until the job runs: the node's ranks said hello
        seen += "pid " in line
        if seen == count:
            return
    raise AssertionError(proc.stderr.read())


@pytest.mark.parametrize("args", [(), ("--abort-on-error",)], ids=["raise", "abort"])
@pytest.mark.parametrize(("lost", "says"), [
    (1, r"node\(s\) 1 lost: no word from their launcher for more than 5 s"),
    (0, r"node 1:? lost contact with node 0 \(the host of the rendezvous store\)"),
])
def test_a_lost_node_stops_the_others_with_an_error_naming_it(lost, says, args, port):
    # "abort": the survivors' ranks die of SIGABRT when the peer goes away, as gloo's or the
    # store's native code sometimes makes them (no Python error, no failure record): the node
    # must still name the lost node, not blame its own rank
    nodes = [_node(port, k, 2, "forever.py", args=args) for k in (0, 1)]
    _wait_for_pids(nodes[1 - lost], 2)
    nodes[lost].send_signal(signal.SIGKILL)
    nodes[lost].wait()
    survivor = nodes[1 - lost]
    _, err = survivor.communicate(timeout=60)
    assert survivor.returncode == 1, err
    assert re.search(says, err), err
    assert "restarting" not in err


def test_a_native_crash_with_every_node_alive_is_blamed_on_its_rank_without_waiting(port):
    # rank 3 (node 1) aborts while the other ranks wait in a barrier: node 1 sees every other
    # node's launcher beat, so the crash is its rank's own and it says so at once; node 0's
    # ranks lose their peer and node 0 repeats node 1's report. The timeout (120 s) is longer
    # than the test waits: waiting it out for a remote cause would fail the test.
    nodes = [_node(port, k, 2, "die_hard.py", timeout="120", args=("3", "abort"))
             for k in (0, 1)]
    errs = [p.communicate(timeout=90)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [1, 128 + signal.SIGABRT], errs
    assert "shardwise: rank 3 was killed by SIGABRT" in errs[1], errs[1]
    assert "lost" not in errs[1]
    assert "shardwise: node 1 failed; this node's ranks were stopped." in errs[0], errs[0]
    assert "rank 3 was killed by SIGABRT" in errs[0]


def test_a_running_nodes_launcher_is_not_replaced_and_a_signal_ends_every_node(port):
    nodes = [_node(port, k, 2, "forever.py", "--max-restarts", "1") for k in (0, 1)]
    _wait_for_pids(nodes[0], 2)
    second = _node(port, 1, 2, "forever.py", "--max-restarts", "1")
    _, err = second.communicate(timeout=60)
    assert second.returncode == 2, err
    assert "two launchers were started with --node-rank 1: the first is still running" in err
    # a signal to one node's launcher ends the job on every node, restarts left or not
    nodes[0].send_signal(signal.SIGTERM)
    errs = [p.communicate(timeout=60)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [128 + signal.SIGTERM, 1], errs
    assert "node 0's launcher received SIGTERM; this node's ranks were stopped" in errs[1]
    assert "restarting" not in errs[0] + errs[1]


# -- a lost node started again under --max-restarts --------------------------------------------

TRAIN_TIMEOUT = "8"  # long enough for a launcher to start again under load
TRAIN = ["--steps", "16", "--checkpoint-every", "4", "--n-layer", "2", "--n-head", "2",
         "--d-model", "32", "--seq-len", "32", "--batch-size", "8", "--lr", "0.003", "--warmup",
         "5", "--eval-batches", "1", "--corpus-bytes", "400000", "--no-progress",
         "--log-every", "1"]
STEP_LINE = re.compile(r"\[rank0\]: step (\d+)/\d+ loss (\S+)$", re.M)


def _train_node(port, node_rank, ck):
    cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", "1", "--nnodes", "2",
           "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--max-restarts", "1", "--grace-seconds", "3", "--checkpoint-dir", str(ck), *TRAIN]
    env = {**os.environ, "SHARDWISE_TIMEOUT": TRAIN_TIMEOUT}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _reference(ctx, cfg):
    from shardwise.cli.train_loop import train

    return train(cfg, ctx.group, torch.device("cpu")).losses


@pytest.mark.parametrize(("lost", "says"), [
    (1, r"node\(s\) 1 lost: no word from their launcher for more than 8 s"),
    (0, r"node 1:? lost contact with node 0 \(the host of the rendezvous store\)"),
])
def test_a_lost_node_started_again_rejoins_and_training_completes(tmp_path, lost, says, port):
    ck = tmp_path / "ck"
    nodes = [_train_node(port, k, ck) for k in (0, 1)]
    for line in nodes[0].stdout:  # node 0 runs rank 0, which reports the steps
        if (m := STEP_LINE.match(line)) and int(m[1]) >= 6:
            break
    nodes[lost].send_signal(signal.SIGKILL)
    nodes[lost].wait()
    again = _train_node(port, lost, ck)  # the node's launcher started again, at once
    survivor = nodes[1 - lost]
    outs = {k: p.communicate(timeout=180) for k, p in ((1 - lost, survivor), (lost, again))}
    assert (survivor.returncode, again.returncode) == (0, 0), outs
    err = outs[1 - lost][1]
    assert re.search(says, err), err
    assert f"waiting up to 8 s for node{'(s)' if lost else ''} {lost} to be started again" in err
    assert "restarting every rank (restart 1 of 1)" in err

    # the group of the restarted attempt resumed from a checkpoint and finished the run with
    # the uninterrupted run's losses
    out0, err0 = outs[0]
    resumed = int(re.search(r"\[rank0\]: resumed from \S+step_(\d+) at step", err0)[1])
    assert resumed >= 4, err0
    steps = {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(out0)}
    assert set(range(resumed + 1, 17)) <= set(steps)  # (and steps of attempt 0 on node 0)
    cfg = dataclasses.replace(TINY, steps=16, eval_batches=1)
    expected = run_on_ranks(2, _reference, cfg)[0]
    for step, loss in steps.items():
        assert loss == pytest.approx(expected[step - 1], abs=1e-6), step
