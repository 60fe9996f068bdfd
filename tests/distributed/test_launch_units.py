"""The launcher's pure parts: blame, the watchdog, failure records, environment validation."""

import pytest

from shardwise.distributed.env import EnvError, flag_var, read_env
from shardwise.distributed.timeouts import default_timeout
from shardwise.launch.blame import RankExit, blame
from shardwise.launch.errors import (
    FailureRecord,
    failure_of,
    is_consequence,
    is_timeout,
    read_record,
    write_record,
)
from shardwise.launch.nodes import NodeError, parse_endpoint
from shardwise.launch.output import stack_dump
from shardwise.launch.watchdog import Watchdog

RESET = "[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"


def _record(rank, t, consequence=False, waiting_for=(), message="boom"):
    return FailureRecord(rank, "RuntimeError", message, f"Traceback\nRuntimeError: {message}", t,
                         consequence, list(waiting_for))


def test_the_earliest_own_failure_is_blamed_even_when_its_rank_exited_last():
    exits = [RankExit(0, 1, 10.0, False, _record(0, 5.2, True, message=RESET)),
             RankExit(1, 1, 11.0, False, _record(1, 5.0, message="rank one broke"))]
    found = blame(exits)
    assert found.ranks == [1] and found.code == 1 and not found.consequence
    assert found.text.startswith("shardwise: rank 1 failed (exit code 1)")
    assert "rank one broke" in found.text


def test_a_killed_rank_is_blamed_with_its_output_not_as_its_error():
    exits = [RankExit(0, 1, 10.2, False, _record(0, 10.1, True, message=RESET)),
             RankExit(1, -9, 10.0, False, None, output=["step 3 loss=1.0\r"])]
    found = blame(exits)
    assert found.ranks == [1] and found.code == 137
    assert "rank 1 was killed by SIGKILL" in found.text
    assert "its output, not an error message" in found.text and "step 3" in found.text


def test_ranks_that_never_arrived_are_named_when_every_failure_is_a_consequence():
    exits = [RankExit(0, 1, 9.0, False, _record(0, 8.0, True, [2, 3], "Timed out waiting")),
             RankExit(1, -15, 9.5, True, None),
             RankExit(2, -15, 9.5, True, None, stack="  File 'x.py', line 3 in <module>"),
             RankExit(3, -15, 9.5, True, None)]
    found = blame(exits)
    assert found.ranks == [2, 3]
    assert found.text.startswith("shardwise: rank(s) 2, 3 never reached the collective that "
                                 "rank 0 waited in")
    assert "rank 2 was at:\n  File 'x.py'" in found.text


def test_ranks_the_launcher_stopped_are_not_blamed():
    exits = [RankExit(0, -15, 9.0, True, None), RankExit(1, 3, 8.0, False, None,
                                                         stderr=["no traceback here"])]
    found = blame(exits)
    assert found.ranks == [1] and found.code == 3
    assert "failed (exit code 3) without a Python exception" in found.text


def test_nothing_to_blame_when_all_succeeded():
    assert blame([RankExit(0, 0, 1.0, False, None)]) is None


def test_watchdog_names_a_rank_whose_heartbeat_stopped():
    dog = Watchdog([0, 1], timeout=5)
    for t in range(0, 20):
        dog.observe(0, {"seq": 1, "beats": 0, "t": float(t)}, float(t))
        if t < 3:
            dog.observe(1, {"seq": 1, "beats": 0, "t": float(t)}, float(t))
        if t <= 7:  # the last beat of rank 1 was at t=2: silent for 5 s, not yet more
            assert dog.verdict(float(t)) is None
    hang = dog.verdict(19.0)
    assert hang.ranks == [1] and "no heartbeat" in hang.reason


def test_watchdog_names_a_rank_left_hanging_after_others_exited_0():
    dog = Watchdog([0, 1, 2], timeout=5)
    for t in range(0, 30):
        for rank in (1, 2):  # alive and beating; rank 2 also makes progress
            dog.observe(rank, {"seq": 4 + (t if rank == 2 else 0), "beats": 0, "t": float(t)},
                        float(t))
        if t == 10:
            dog.exited(0, 0, 10.0)
        if t <= 15:
            assert dog.verdict(float(t)) is None, t
    hang = dog.verdict(29.0)
    assert hang.ranks == [1] and "after rank(s) 0 exited 0" in hang.reason


def test_failure_records_round_trip_through_torchelastic_error_file(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        record = failure_of(exc, 3, [1])
    assert write_record(record) == path
    again = read_record(path)
    assert again == record and not again.consequence
    assert '"py_callstack"' in path.read_text()  # torchrun's layout
    path.write_text('{"message": {"message": "from torchrun"}}')
    assert read_record(path) is None


@pytest.mark.parametrize(("exc", "consequence", "timeout"), [
    (RuntimeError(RESET), True, False),
    (RuntimeError("Connection closed by peer [127.0.0.1]:4"), True, False),
    (RuntimeError("Timed out waiting 3000ms for recv operation to complete"), True, True),
    (ValueError("the timeout must be positive"), False, False),
    (KeyError("x"), False, False),
])
def test_consequences_and_timeouts_are_told_apart(exc, consequence, timeout):
    assert is_consequence(exc) is consequence
    assert is_timeout(exc) is timeout


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "soon"])
def test_a_bad_shardwise_timeout_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SHARDWISE_TIMEOUT", value)
    with pytest.raises(EnvError, match=f"environment variable SHARDWISE_TIMEOUT must be .*"
                                       f"got '{value}'"):
        default_timeout()


@pytest.mark.parametrize(("env", "says"), [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'x'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1, got 0"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT must be at most"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "-1"},
     "TORCHELASTIC_RESTART_COUNT must be at least 0"),
])
def test_launch_variables_are_validated_by_name(monkeypatch, env, says):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(EnvError, match=says.replace("[", r"\[")):
        read_env()


def test_a_bad_flag_variable_is_named(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "maybe")
    with pytest.raises(EnvError, match="TORCHELASTIC_USE_AGENT_STORE must be 1/true/yes"):
        flag_var("TORCHELASTIC_USE_AGENT_STORE")


@pytest.mark.parametrize("endpoint", ["localhost", "host:", ":29500", "host:99999", "h:x"])
def test_a_bad_rdzv_endpoint_is_named(endpoint):
    with pytest.raises(NodeError, match="--rdzv-endpoint must be host:port"):
        parse_endpoint(endpoint)


def test_stack_dump_keeps_the_main_thread_without_the_launch_frames():
    lines = ["noise", "Thread 0x01 (most recent call first):",
             '  File "threading.py", line 1 in wait', "",
             "Current thread 0x02 (most recent call first):",
             '  File "train.py", line 9 in step', '  File "train.py", line 20 in <module>',
             '  File "<frozen runpy>", line 88 in _run_code',
             '  File "/x/shardwise/launch/bootstrap.py", line 48 in main']
    assert stack_dump(lines) == ("Current thread 0x02 (most recent call first):\n"
                                 '  File "train.py", line 9 in step\n'
                                 '  File "train.py", line 20 in <module>')


def test_without_records_a_consequence_traceback_is_not_blamed_over_a_real_one():
    # a command not started through bootstrap.py: only exit order and stderr are known
    reset = ["[rank0]: Traceback (most recent call last):", f"[rank0]: RuntimeError: {RESET}"]
    real = ["[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: broke"]
    found = blame([RankExit(0, 1, 5.0, False, None, stderr=reset),
                   RankExit(1, 1, 6.0, False, None, stderr=real)])
    assert found.ranks == [1]
    assert found.text.endswith("rank 1's error:\nTraceback (most recent call last):\n"
                               "ValueError: broke")


def test_a_rank_stopped_after_recording_its_failure_is_blamed_for_what_it_raised():
    exits = [RankExit(0, 1, 5.0, False, _record(0, 4.9, True, message=RESET)),
             RankExit(1, -15, 7.0, True, _record(1, 4.8, message="rank one broke"))]
    found = blame(exits)
    assert found.ranks == [1] and found.code == 1
    assert found.text.startswith("shardwise: rank 1 failed (it raised)")


def _reads(name):
    """Callables that read one environment variable each, through the library's own code."""
    from shardwise.distributed.topology import local_world_size_from_env
    from shardwise.launch import lifeline
    from shardwise.launch.preemption import GRACE_VAR, Preemption
    from shardwise.rpc import init_rpc
    from shardwise.rpc.rendezvous import _store_address
    from shardwise.rpc.wire.shm_channel import channel_mode

    return {
        "SHARDWISE_TIMEOUT": default_timeout,
        GRACE_VAR: Preemption,
        "LOCAL_WORLD_SIZE": lambda: local_world_size_from_env(4),
        "MASTER_PORT": lambda: _store_address("env://"),
        "RANK": lambda: init_rpc("worker"),
        "WORLD_SIZE": lambda: init_rpc("worker", rank=0),
        lifeline.LAUNCHER_FD_VAR: lifeline.install,
        "SHARDWISE_RPC_CHANNEL": channel_mode,
    }[name]


@pytest.mark.parametrize("name", ["SHARDWISE_TIMEOUT", "SHARDWISE_GRACE_SECONDS",
                                  "LOCAL_WORLD_SIZE", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                  "SHARDWISE_LAUNCHER_FD", "SHARDWISE_RPC_CHANNEL"])
def test_every_variable_the_library_reads_is_validated_by_name(monkeypatch, name):
    # a malformed value is an EnvError naming the variable, not a bare conversion error
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for other in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.setenv(other, "1" if other != "RANK" else "0")
    monkeypatch.setenv(name, "nan")
    with pytest.raises(EnvError, match=f"environment variable {name} must be"):
        _reads(name)()


def test_watchdog_is_patient_with_a_rank_that_said_it_is_exiting():
    # its script is done; the interpreter's teardown may outlast the timeout on a loaded machine
    from shardwise.launch.watchdog import EXIT_PATIENCE

    dog = Watchdog([0, 1], timeout=5)
    dog.observe(0, {"seq": 3, "beats": 0, "t": 0.0, "exiting": False}, 0.0)
    dog.observe(1, {"seq": 3, "beats": 0, "t": 0.0, "exiting": False}, 0.0)
    dog.observe(0, {"seq": 3, "beats": 0, "t": 1.0, "exiting": True}, 1.0)
    dog.exited(1, 0, 1.0)
    assert dog.verdict(1.0 + 5 * EXIT_PATIENCE - 1) is None
    hang = dog.verdict(1.0 + 5 * EXIT_PATIENCE + 1)
    assert hang.ranks == [0] and hang.reason == f"finished but did not exit within " \
        f"{5 * EXIT_PATIENCE} s"
    # a rank that did not say so is named after the timeout, as before
    dog = Watchdog([0, 1], timeout=5)
    dog.observe(0, {"seq": 3, "beats": 0, "t": 0.0, "exiting": False}, 0.0)
    dog.exited(1, 0, 1.0)
    assert dog.verdict(6.5).ranks == [0]


# -- a node's report when its rank crashed in native code (several nodes) ----------------------

class _FakeLink:
    """The NodeLink calls the launcher makes while it reports, over a store whose host is gone
    (``store_gone``), or with node 1 alive (its beat moves) or silent (declared lost on the
    third look)."""

    def __init__(self, store_gone=False, peer_alive=True):
        self.store_gone, self.peer_alive, self.looks, self.reported = store_gone, peer_alive, 0, []

    def _store(self):
        if self.store_gone:
            raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def stopped(self):
        self._store()
        self.looks += 1
        return None

    def remote_failure(self, attempt):
        return None

    def lost_nodes(self, now):
        return [] if self.peer_alive or self.looks < 3 else [1]

    def beaten_since(self, t):
        return self.peer_alive

    def never_connected(self, nodes):
        return False

    def report_failure(self, attempt, text):
        self._store()
        self.reported.append(text)


def _job(link):
    import io

    from shardwise.launch.launcher import _Job

    return _Job(argv=[], base_env={}, stdout=io.StringIO(), stderr=io.StringIO(),
                max_restarts=1, grace=1.0, timeout=30.0, link=link, nnodes=2, node_rank=1)


def _aborted():
    found = blame([RankExit(2, -6, 10.0, False, None, output=["terminate called"]),
                   RankExit(3, 1, 10.1, True, None)])
    assert found.native and not found.consequence
    return found


def test_a_native_crash_when_the_store_host_is_gone_reports_the_lost_store_and_restarts():
    job = _job(_FakeLink(store_gone=True))
    assert job._report(0, _aborted()) == 1  # not the rank's SIGABRT: node 0 went away
    assert "node 1 lost contact with node 0 (the host of the rendezvous store)" in \
        job.stderr.getvalue()
    assert job.store_lost  # the next attempt connects to node 0's new launcher


def test_a_native_crash_while_a_node_is_silent_names_that_node():
    link = _FakeLink(peer_alive=False)
    job = _job(link)
    assert job._report(0, _aborted()) == 1
    assert "node(s) 1 lost: no word from their launcher" in job.stderr.getvalue()
    assert job.lost_nodes == [1] and link.reported == [job.stderr.getvalue().strip()]


def test_a_native_crash_with_every_node_beating_is_the_ranks_own():
    link = _FakeLink()
    job = _job(link)
    assert job._report(0, _aborted()) == 128 + 6
    assert job.stderr.getvalue().strip().startswith("shardwise: rank 2 was killed by SIGABRT")
    assert link.looks <= 3 and not job.store_lost  # it did not wait for the timeout


def test_a_python_error_of_its_own_is_reported_without_waiting_for_other_nodes():
    link = _FakeLink(peer_alive=False)
    job = _job(link)
    found = blame([RankExit(2, 1, 10.0, False, _record(2, 9.9, message="rank two broke"))])
    assert job._report(0, found) == 1
    assert "rank two broke" in job.stderr.getvalue() and link.looks <= 1  # no waiting


# -- records a process without the job's secret writes change nothing (issue 25, point 5) --

def _links(n=2, timeout=30.0):
    import torch.distributed as dist

    from shardwise.launch.nodes import NodeLink

    store = dist.HashStore()
    return store, [NodeLink(store, k, n, 1, 0, timeout, b"job secret") for k in range(n)]


def test_forged_node_records_are_ignored():
    store, (node0, node1) = _links()
    # what a process that reaches the store but lacks the secret writes, as plain values
    store.set("shardwise/nodes/1", '{"nnodes": 2, "nproc": 1, "max_restarts": 5}')
    store.set("shardwise/node_lost/1", "1")
    assert node0._records().keys() == set()  # node 0 has not written its record either
    assert not node1._take("shardwise/node_lost/1")


def test_a_forged_claim_is_taken_over_and_a_true_one_is_not():
    store, (node0, _) = _links()
    store.set("shardwise/node_claims/0", "someone")
    assert node0._claim()
    store2, (first, _) = _links()
    assert first._claim()
    from shardwise.launch.nodes import NodeLink

    second = NodeLink(store2, 0, 2, 1, 0, 30.0, b"job secret")
    assert not second._claim()  # a second launcher for node 0: a true claim is there


def test_a_forged_or_replayed_progress_record_is_false():
    import json

    import torch.distributed as dist

    from shardwise.launch import progress

    store = dist.HashStore()
    beat = progress.Heartbeat(store, 0, 1, 2, interval=1.0, secret=b"job secret")
    beat.publish()
    first = progress.read_progress(store, 0, 1, b"job secret")
    assert first["n"] == 1
    old = store.get(progress.progress_key(0, 1))
    beat.publish()
    newest = progress.read_progress(store, 0, 1, b"job secret", first)
    assert newest["n"] == 2
    store.set(progress.progress_key(0, 1), old)  # a true record written back
    assert progress.read_progress(store, 0, 1, b"job secret", newest) is progress.FALSE
    store.set(progress.progress_key(0, 1), json.dumps({"seq": 0, "beats": 0, "t": 1.0}))
    assert progress.read_progress(store, 0, 1, b"job secret", newest) is progress.FALSE
    assert progress.read_progress(store, 0, 1, b"another secret") is progress.FALSE


def test_a_rank_that_left_with_exit_code_0_is_named_before_the_consequence():
    exits = [RankExit(0, 1, 5.2, False, _record(0, 5.1, True, message=RESET)),
             RankExit(1, 0, 5.0, False, None)]
    found = blame(exits)
    assert found.ranks == [1] and found.code == 1 and not found.consequence
    assert found.text.startswith("shardwise: rank 1 left first (exit code 0, 0.10 s before "
                                 "rank 0 failed)"), found.text
    assert "then: rank 0 failed" in found.text


def test_a_real_error_still_comes_before_a_rank_that_left():
    exits = [RankExit(0, 0, 4.0, False, None),
             RankExit(1, 1, 5.0, False, _record(1, 4.9, message="rank one broke"))]
    assert blame(exits).text.startswith("shardwise: rank 1 failed")


def test_a_progress_record_of_another_job_or_attempt_is_false():
    import torch.distributed as dist

    from shardwise.launch import progress

    store = dist.HashStore()
    mine, other = progress.scope_of("aa" * 32), progress.scope_of("bb" * 32)
    # another job with the same secret (or an earlier attempt) wrote rank 1's record
    progress.Heartbeat(store, 0, 1, 2, interval=1.0, secret=b"job secret", scope=other).publish()
    assert progress.read_progress(store, 0, 1, b"job secret", scope=mine) is progress.FALSE
    beat = progress.Heartbeat(store, 0, 1, 2, interval=1.0, secret=b"job secret", scope=mine)
    beat.publish()
    assert progress.read_progress(store, 0, 1, b"job secret", scope=mine)["n"] == 1


def test_a_lost_mark_of_another_job_with_the_same_secret_is_not_taken():
    store, (node0, node1) = _links()
    node0.job_id, node1.job_id = b"a" * 32, b"b" * 32  # two jobs, one secret
    node0.mark_lost([1], 1)
    assert not node1._take("shardwise/node_lost/1")
    node1.job_id = node0.job_id
    assert node1._take("shardwise/node_lost/1") and not node1._take("shardwise/node_lost/1")
