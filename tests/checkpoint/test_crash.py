"""A process killed at any point of a save never leaves a checkpoint that load accepts: a new
checkpoint is absent (an incomplete-save error), an older one of the same name stays whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import CheckpointError, load, save
from tests.harness import procs

SCRIPT = Path(__file__).with_name("crash_save.py")
POINTS = [("chunk", 0, "sync"), ("chunk", 1, "sync"), ("parts", 0, "sync"),
          ("metadata", 0, "sync"), ("chunk", 0, "async"), ("metadata", 0, "async")]


def _crash(directory: Path, point: str, index: int, mode: str) -> None:
    # `python crash_save.py ...`, started by tests/harness/procs.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = procs.run([str(SCRIPT), str(directory), point, str(index), mode], env, timeout=120)
    assert proc.returncode == 17, proc.stderr


def _target():
    return {"a": torch.zeros(50, 40), "b": torch.zeros(40), "v": 0}


@pytest.mark.parametrize(("point", "index", "mode"), POINTS)
def test_crash_during_first_save_leaves_nothing_loadable(tmp_path, point, index, mode):
    _crash(tmp_path / "ck", point, index, mode)
    with pytest.raises(CheckpointError, match="incomplete: a save did not finish"):
        load(_target(), checkpoint_id=tmp_path / "ck")


@pytest.mark.parametrize(("point", "index", "mode"), POINTS[1:4])
def test_crash_while_overwriting_keeps_the_old_checkpoint(tmp_path, point, index, mode):
    save({"a": torch.ones(50, 40), "b": torch.ones(40), "v": 1}, checkpoint_id=tmp_path / "ck")
    _crash(tmp_path / "ck", point, index, mode)
    target = _target()
    load(target, checkpoint_id=tmp_path / "ck")
    assert target["v"] == 1 and bool((target["a"] == 1).all()) and bool((target["b"] == 1).all())
    save({"a": torch.ones(50, 40), "b": torch.ones(40), "v": 3}, checkpoint_id=tmp_path / "ck")
    load(target, checkpoint_id=tmp_path / "ck")  # the leftover .tmp is replaced
    assert target["v"] == 3


FULL_DISK = """
import resource, signal, sys, torch
from shardwise.checkpoint import CheckpointError, async_save, save
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # room for half of 'a' only
state = {"a": torch.full((50, 40), 2.0), "b": torch.full((40,), 2.0), "v": 2}
try:
    if sys.argv[2] == "sync":
        save(state, checkpoint_id=sys.argv[1])
    else:
        async_save(state, checkpoint_id=sys.argv[1]).result()
except (CheckpointError, OSError) as err:
    print(type(err).__name__, err)
    sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_disk_that_fills_during_save_keeps_the_previous_checkpoint(tmp_path, mode):
    """A write that fails for lack of room (the kernel refuses it: RLIMIT_FSIZE) is a clear
    error, and the checkpoint it was replacing still loads whole."""
    save({"a": torch.ones(50, 40), "b": torch.ones(40), "v": 1}, checkpoint_id=tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "ck"), mode],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "File too large" in proc.stdout, proc.stdout
    if mode == "sync":
        assert "save failed while writing: rank 0" in proc.stdout, proc.stdout
    target = _target()
    load(target, checkpoint_id=tmp_path / "ck")
    assert target["v"] == 1 and bool((target["a"] == 1).all()) and bool((target["b"] == 1).all())
