"""The launcher relays prefixed output, stops everyone when a rank fails, and a missing rank is a
named timeout rather than a hang."""

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwise.distributed import RendezvousTimeout, init
from shardwise.launch import launch
from tests.harness.ports import closed_port

SCRIPTS = Path(__file__).parent / "scripts"


def _launch(nproc, script, *args):
    out, err = io.StringIO(), io.StringIO()
    code = launch(nproc, [sys.executable, str(SCRIPTS / script), *args], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_every_rank_runs_and_output_is_prefixed():
    code, out, _ = _launch(3, "sum_ranks.py")
    assert code == 0
    for rank in range(3):
        assert f"[rank{rank}]: sum=3 world=3" in out.splitlines()


def test_failing_rank_stops_the_others_and_its_traceback_is_shown():
    code, out, err = _launch(2, "fail_on_rank1.py")
    assert code != 0
    assert "[rank0]: hello from rank 0" in out
    assert "rank 1 failed (exit code 1)" in err
    tail = err.split("rank 1's error:")[1]
    assert "Traceback (most recent call last)" in tail
    assert "ValueError: rank one broke on purpose" in tail


def test_bad_nproc_is_an_error():
    with pytest.raises(ValueError, match="nproc must be at least 1"):
        launch(0, [sys.executable, "-c", "pass"])


def test_rank_that_never_joins_is_named_after_the_timeout():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    with pytest.raises(RendezvousTimeout, match=r"only 1 of 2 ranks joined .*missing ranks: \[1\]"):
        init("gloo", rank=0, world_size=2, store=store, timeout=2)
    assert not dist.is_initialized()


def test_unreachable_store_is_a_clear_error():
    with closed_port() as port, pytest.raises(RendezvousTimeout,
                                              match="could not reach the rendezvous store"):
        init("gloo", rank=1, world_size=2, master_port=port, timeout=2)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_shardwise_init_works_under_torchrun():
    cmd = ["torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           str(SCRIPTS / "shardwise_init.py")]
    torchrun = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # a bound that only stops a hang: three interpreters import torch on a busy machine
        out, err = torchrun.communicate(timeout=600)
    finally:
        if torchrun.poll() is None:  # SIGTERM: torchrun stops its workers (SIGKILL orphans them)
            torchrun.terminate()
            torchrun.communicate(timeout=120)
    assert torchrun.returncode == 0, err
    assert "rank 0 backend=gloo total=2" in out
    assert "rank 1 backend=gloo total=2" in out


@pytest.mark.parametrize("given", [None, "0"])
def test_ranks_get_huge_pages_for_large_tensors_unless_told_otherwise(given, monkeypatch):
    from shardwise.launch.launcher import THP_VAR, huge_pages_on_request

    if given is None:
        monkeypatch.delenv(THP_VAR, raising=False)
    else:
        monkeypatch.setenv(THP_VAR, given)
    out = io.StringIO()
    code = launch(1, [sys.executable, "-c", f"import os; print(os.environ.get('{THP_VAR}'))"],
                  stdout=out, stderr=io.StringIO())
    assert code == 0
    want = given if given is not None else ("1" if huge_pages_on_request() else "None")
    assert out.getvalue().split(": ")[-1].strip() == want


@pytest.mark.parametrize("mode, granted", [("always [madvise] never", True),
                                           ("[always] madvise never", True),
                                           ("always madvise [never]", False)])
def test_huge_pages_follow_the_kernels_mode(tmp_path, mode, granted):
    from shardwise.launch.launcher import huge_pages_on_request

    (tmp_path / "enabled").write_text(mode + "\n")
    assert huge_pages_on_request(str(tmp_path / "enabled")) is granted
    assert huge_pages_on_request(str(tmp_path / "missing")) is False
