"""What the launcher must not miss (issue 25, point 6): a rank that leaves with exit code 0 is
named first; every process a rank started ends with the job, in all five endings; the lifeline
holds while the ranks still import torch."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.launch import descendants, launch
from shardwise.launch.launcher import python_command
from tests.distributed import test_launch_faults as faults
from tests.distributed.test_launch_faults import _report
from tests.harness import procs
from tests.harness.pace import alive, assert_gone

SCRIPTS = Path(__file__).parent / "scripts"
GRACE = 2.0
LONG = 60.0
STARTUP = 600.0  # a bound on two ranks' start (their import of torch) at any load: no verdict


def _launch(nproc, script, *args, **kwargs):
    return faults._launch(nproc, script, *args, grace_seconds=GRACE, **kwargs)


def _kill_quietly(pids):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- the rank that left first ---------------------------------------------------------------

def _check_leaver_named(rank):
    code, _, err = _launch(2, "leave_at_step3.py", str(rank))
    report = _report(err)
    assert code == 1, err
    assert re.match(rf"shardwise: rank {rank} left first \(exit code 0, [0-9.]+ s (before|after) "
                    rf"rank {1 - rank} failed", report), report
    # the consequence comes after, and is said to be one
    assert "then: rank" in report and report.index("then:") > report.index("left first")


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_rank_that_leaves_with_exit_code_0_is_named_first(rank):
    _check_leaver_named(rank)


@pytest.mark.slow  # 20 launches: `pytest -m slow`
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_leaves_is_named_first_ten_times_of_ten(rank):
    for _ in range(10):
        _check_leaver_named(rank)


# -- descendants end with the job -----------------------------------------------------------

def _grandchildren(folder, count=2, timeout=STARTUP):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob("rank_*.pid"))
        if len(found) == count:
            return [int(p.read_text()) for p in found]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start their children: {list(folder.iterdir())}")


@pytest.mark.parametrize(("how", "code"), [pytest.param("ok", 0, marks=pytest.mark.slow),
                                           ("fail", 1)])
def test_a_child_that_ignores_sigterm_ends_with_the_job(tmp_path, how, code):
    got, _, err = _launch(2, "grandchild.py", str(tmp_path), how)
    pids = _grandchildren(tmp_path, timeout=1)
    try:
        assert got == code, err
        # launch() returned: the sweep already ran (SIGTERM, the grace period, SIGKILL); a
        # bound scaled to the machine (tests/harness/pace.py) for the last reaping
        assert_gone(pids, what=f"children left by the ranks:\n{err}\n")
        assert "process(es) the ranks had started and left running" in err
    finally:
        _kill_quietly(pids)


_SETSID = ("import os, runpy, sys; os.setsid(); sys.argv = ['shardwise', *sys.argv[1:]]; "
           "runpy.run_module('shardwise', run_name='__main__', alter_sys=True)")


def _start_launcher(folder, setsid=False):
    args = ["run", "--nproc", "2", "--grace-seconds", str(GRACE),
            str(SCRIPTS / "grandchild.py"), str(folder), "wait"]
    cmd = ["-c", _SETSID, *args] if setsid else ["-m", "shardwise", *args]
    return procs.start(cmd, dict(os.environ, OMP_NUM_THREADS="1"), merge_stderr=False,
                        streams=True)


@pytest.mark.parametrize("ending", [pytest.param("sigterm", marks=pytest.mark.slow),
                                    pytest.param("setsid", marks=pytest.mark.slow), "sigkill"])
def test_a_child_that_ignores_sigterm_ends_when_the_launcher_is_stopped(tmp_path, ending):
    launcher = _start_launcher(tmp_path, setsid=ending == "setsid")
    pids = []
    try:
        pids = _grandchildren(tmp_path)
        if ending == "sigterm":
            launcher.send_signal(signal.SIGTERM)
        elif ending == "setsid":  # the launcher leads its own session: its whole group
            os.killpg(launcher.pid, signal.SIGTERM)
        else:
            launcher.kill()
        # the guard or the launcher's sweep SIGKILLs them after at most the grace period
        assert_gone(pids, plus=GRACE, what="the ranks' children")
        expected = -signal.SIGKILL if ending == "sigkill" else 128 + signal.SIGTERM
        assert launcher.wait(timeout=60) == expected
    finally:
        _kill_quietly(pids)
        if launcher.poll() is None:
            launcher.kill()


# -- the lifeline is armed before the heavy imports ----------------------------------------

def _children(pid):
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return found


def test_sigkill_to_the_launcher_while_its_ranks_import_torch_leaves_no_rank():
    # the ranks' rendezvous timeout is far longer than any wait below: without the lifeline a
    # rank would live on, retrying the dead launcher's store, long after the bound
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDWISE_TIMEOUT="3600")
    launcher = procs.start(["-m", "shardwise", "run", "--nproc", "2", "--grace-seconds",
                             str(GRACE), str(SCRIPTS / "forever.py")], env, merge_stderr=False,
                            streams=True)
    ranks = []
    try:
        deadline = time.monotonic() + STARTUP
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [p for p in _children(launcher.pid) if alive(p)]
            time.sleep(0.01)
        assert len(ranks) == 2
        launcher.kill()  # the ranks are still starting: importing shardwise and torch
        launcher.wait()
        # a rank not armed yet exits when it arms the lifeline (its launcher gone), before it
        # imports torch; an armed one at once: both within a bound scaled to the machine now
        # (tests/harness/pace.py), which a rank without the lifeline outlives
        assert_gone(ranks, what="rank(s)")
    finally:
        _kill_quietly(ranks)


def test_a_launcher_on_its_way_out_counts_as_gone_for_the_guard():
    # a guard whose rank died first (PR_SET_PDEATHSIG fires when the launcher's thread that
    # started it exits) sweeps the rank's children when the launcher is exiting, not only
    # once its end of the lifeline pipe is closed (its last thread gone)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not descendants.exiting(os.getpid()) and not descendants.exiting(child.pid)
        child.kill()
        assert_gone([child.pid], what="the killed child")  # a zombie until it is reaped
        assert descendants.exiting(child.pid)
    finally:
        child.kill()
        child.wait()
    assert descendants.exiting(child.pid)


def test_the_lifeline_is_armed_before_shardwise_or_torch_is_imported():
    # a rank whose launcher is already gone (its PID is not the parent's) exits at once, and
    # `-X importtime` shows that nothing of shardwise or torch was imported before
    cmd = python_command(str(SCRIPTS / "forever.py"))
    env = {**os.environ, "SHARDWISE_LAUNCHER_PID": "1", "RANK": "3"}
    env.pop("SHARDWISE_LAUNCHER_FD", None)
    done = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], env=env, capture_output=True,
                          text=True, timeout=LONG)
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert "shardwise: rank 3: the launcher is gone; exiting" in done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")]
    assert imported and not [m for m in imported if m.split(".")[0] in ("torch", "shardwise")]


# -- a forged progress record changes nothing (issue 25, point 5) ---------------------------

def test_a_forged_progress_record_blames_no_one(caplog):
    # rank 0 writes, every millisecond, a frozen record over rank 1's for 6 s, twice the
    # watchdog's patience: the job must finish and no one be named
    out, err = io.StringIO(), io.StringIO()
    env = {**os.environ, "SHARDWISE_TIMEOUT": str(LONG)}
    with caplog.at_level("WARNING", logger="shardwise.store"):
        code = launch(2, python_command(str(SCRIPTS / "forge_progress.py"), ["6"]), env=env,
                      stdout=out, stderr=err, timeout=3.0, grace_seconds=GRACE)
    assert code == 0, err.getvalue()
    assert "[rank1]: rank 1 done" in out.getvalue()
    assert "no heartbeat" not in err.getvalue()
    # the watchdog reads each rank's own pipe, not the store: the forgery is never even read
    # ([Note: progress records]; tests/distributed/test_launch_store_tampering.py)
    assert "shardwise/progress/attempt_0/rank_1" not in caplog.text
