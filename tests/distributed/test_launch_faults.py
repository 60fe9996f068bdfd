"""The launcher under failures: the right rank is blamed, hangs are stopped and named, restarts.

Every job here is a tiny script (tests/distributed/scripts) run in-process through ``launch``
with short timeouts only where a timeout is the subject, so that each costs about the import of
torch in two ranks.
"""

import io
import os
import re
from pathlib import Path

import pytest

from shardwise.launch import launch
from shardwise.launch.launcher import python_command

SCRIPTS = Path(__file__).parent / "scripts"
SHORT = 5.0  # seconds: the timeout a test is about (a collective's, or the watchdog's patience)
LONG = 60.0  # for everything else: a loaded machine must not turn a slow start into a timeout


def _launch(nproc, script, *args, timeout=LONG, rank_timeout=None, grace_seconds=5.0, **kwargs):
    """``timeout``: the watchdog's; ``rank_timeout`` (default: the same): SHARDWISE_TIMEOUT for
    the ranks' rendezvous and collectives."""
    out, err = io.StringIO(), io.StringIO()
    env = {**os.environ, "SHARDWISE_TIMEOUT": str(rank_timeout or timeout)}
    code = launch(nproc, python_command(str(SCRIPTS / script), args), env=env, stdout=out,
                  stderr=err, timeout=timeout, grace_seconds=grace_seconds, **kwargs)
    return code, out.getvalue(), err.getvalue()


def _report(err):
    """The launcher's own report: what follows its last 'shardwise:' line at column 0."""
    lines = err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("shardwise: ")]
    assert starts, err
    return "\n".join(lines[starts[-1]:])


@pytest.mark.slow  # 20 launches: `pytest -m slow`
def test_a_raising_rank_1_is_blamed_every_time():
    # rank 0 fails too, moments later, with gloo's "Connection closed by peer": a consequence.
    # Half the runs make rank 1 exit a second after rank 0, so exit order would blame rank 0.
    for attempt in range(20):
        script = "fail_then_linger.py" if attempt % 2 else "fail_on_rank1.py"
        code, _, err = _launch(2, script)
        report = _report(err)
        assert code == 1, err
        # "it raised": its failure record came while it was still tearing down
        assert re.match(r"shardwise: rank 1 failed \((exit code 1|it raised)\)", report), report
        assert "ValueError: rank one broke on purpose" in report
        assert "Connection closed" not in report


def test_a_rank_that_sleeps_before_a_collective_is_named():
    code, _, err = _launch(2, "sleep_before_collective.py", str(SHORT), timeout=SHORT,
                           rank_timeout=LONG)
    report = _report(err)
    assert code == 1
    assert report.startswith("shardwise: rank(s) 1 never reached the collective that rank 0 "
                             "waited in"), report
    assert "rank 1 was at:" in report and "sleep_before_collective.py" in report


def test_a_rank_left_hanging_after_the_others_exit_is_stopped_and_named():
    code, out, err = _launch(2, "hang_after_others.py", timeout=SHORT, rank_timeout=LONG)
    report = _report(err)
    assert code == 1
    assert "[rank0]: rank 0 done" in out
    assert report.startswith("shardwise: rank(s) 1 neither finished nor made progress"), report
    assert "after rank(s) 0 exited 0" in report
    assert 'hang_after_others.py", line 11 in <module>' in report  # where it hung


def test_a_frozen_rank_is_named_by_its_missing_heartbeat():
    code, _, err = _launch(2, "freeze_self.py", timeout=SHORT, rank_timeout=LONG)
    assert code == 1
    assert _report(err).startswith(
        f"shardwise: rank(s) 1 stopped making progress: no heartbeat for more than {SHORT:g} s")


def test_a_killed_rank_is_reported_killed_with_its_output_as_output():
    code, _, err = _launch(2, "kill_self.py")
    report = _report(err)
    assert code == 128 + 9
    assert report.startswith("shardwise: rank 1 was killed by SIGKILL"), report
    assert "last output lines (its output, not an error message):\n  | step 7/10 loss=1.23" \
        in report
    assert "error:" not in report


def test_restart_after_a_failure_runs_a_fresh_attempt():
    code, out, err = _launch(2, "restart_once.py", max_restarts=1)
    assert code == 0, err
    assert "restarting every rank (restart 1 of 1)" in err
    assert "[rank0]: attempt 1 total=2" in out and "[rank1]: attempt 1 total=2" in out


@pytest.mark.slow  # max_restarts=0 is the default every other failing job here runs with
def test_without_restarts_the_first_failure_ends_the_job():
    code, out, err = _launch(2, "restart_once.py", max_restarts=0)
    assert code == 1
    assert "attempt 1" not in out
    assert "RuntimeError: first attempt fails on purpose" in _report(err)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# rank 0 (which hosts the store) killed, and rank 1's exit code, in the default run; rank 0's
# exit code, a combination of the two, with the slow tests
@pytest.mark.parametrize(("rank", "how", "code", "says"), [
    (0, "kill", 128 + 9, "rank 0 was killed by SIGKILL"),
    (1, "exit3", 3, "rank 1 failed (exit code 3) without a Python exception"),
    pytest.param(0, "exit3", 3, "rank 0 failed (exit code 3) without a Python exception",
                 marks=pytest.mark.slow),
])
def test_a_rank_that_dies_is_named_and_no_rank_is_left(rank, how, code, says):
    got, out, err = _launch(2, "die_hard.py", str(rank), how)
    assert got == code, err
    assert _report(err).startswith(f"shardwise: {says}"), err
    pids = [int(line.split()[-1]) for line in out.splitlines() if " pid " in line]
    assert len(pids) == 2 and all(_gone(p) for p in pids), out
