"""Signals to the launcher: no rank outlives it (checked by PID) and it exits 128+signal."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import procs
from tests.harness.pace import assert_gone

SCRIPTS = Path(__file__).parent / "scripts"
GRACE = 2.0


def _start_job(*script_args):
    cmd = ["-m", "shardwise", "run", "--nproc", "2", "--grace-seconds", str(GRACE),
           str(SCRIPTS / "forever.py"), *script_args]
    # the launcher started by tests/harness/procs.py (forked from its server), read
    # as it runs; its ranks get OMP_NUM_THREADS=1 as the launcher gave them on two cores
    launcher = procs.start(cmd, dict(os.environ, OMP_NUM_THREADS="1"), merge_stderr=False,
                            streams=True)
    pids = {}
    while len(pids) < 2:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        if "pid " in line:
            rank, pid = line.split("pid ", 1)[1].split()
            pids[int(rank)] = int(pid)
    return launcher, list(pids.values())


# SIGHUP is forwarded as SIGINT is: with the slow tests
@pytest.mark.parametrize(("sig", "ignore_term"), [
    (signal.SIGTERM, True), pytest.param(signal.SIGHUP, False, marks=pytest.mark.slow),
    (signal.SIGINT, False)])
def test_signal_stops_every_rank_within_the_grace_period(sig, ignore_term):
    # ignore_term: the ranks ignore SIGTERM, so the launcher must kill them after the grace period
    launcher, pids = _start_job(*(["--ignore-term"] if ignore_term else []))
    launcher.send_signal(sig)
    # the launcher SIGKILLs what the grace period left: gone within it, plus a bound scaled to
    # the machine now (tests/harness/pace.py) for the launcher's own reaction
    assert_gone(pids, plus=GRACE, what="rank(s)")
    # the ranks are gone (above); the launcher itself may take seconds more to tear down
    assert launcher.wait(timeout=60) == 128 + sig
    assert f"received {signal.Signals(sig).name}" in launcher.stderr.read()


def test_sigkill_to_the_launcher_takes_its_ranks_down():
    launcher, pids = _start_job("--ignore-term")
    launcher.kill()
    launcher.wait()
    assert_gone(pids, plus=GRACE, what="rank(s)")  # their lifeline: PR_SET_PDEATHSIG, the pipe


def test_the_lifeline_pipe_alone_ends_a_rank_when_the_launcher_end_closes():
    # the portable half of the lifeline (no PR_SET_PDEATHSIG): end-of-file on the pipe
    read_end, write_end = os.pipe()
    code = ("import time; from shardwise.launch import lifeline; lifeline.install(); "
            "print('ready', flush=True); time.sleep(60)")
    env = {**os.environ, "SHARDWISE_LAUNCHER_FD": str(read_end), "RANK": "5"}
    env.pop("SHARDWISE_LAUNCHER_PID", None)
    child = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(read_end,),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(read_end)
    assert child.stdout.readline() == "ready\n"
    os.close(write_end)
    assert child.wait(timeout=30) == 128 + signal.SIGHUP
    assert "shardwise: rank 5: the launcher is gone; exiting" in child.stderr.read()
