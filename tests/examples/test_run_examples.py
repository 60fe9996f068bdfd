"""Every example runs as its docstring says, ``shardwise run --nproc N examples/NAME.py`` (N from
``nproc: N``, else 2), exits 0 and prints its own success line (``ok: ...`` from some rank):
each example checks what it shows (losses, agreement, a single-process reference) and exits
non-zero otherwise. ``examples/pipeline_gpt.py`` also runs plainly, starting its own processes.

Marked ``examples`` (left out of the default run by pyproject's addopts): the launches take
minutes on two cores. ``python -m pytest -m examples`` runs them.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.examples.blocks import EXAMPLES, example_files, nproc
from tests.harness import procs

pytestmark = pytest.mark.examples

TIMEOUT = 900  # seconds: a bound so that nothing hangs, far above a run at load 20
SUCCESS = re.compile(r"^(\[rank\d+\]: )?ok: ", re.MULTILINE)
# what the launcher sets for its ranks; the examples' launcher must not inherit a job's
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check(done, what: str) -> None:
    out = f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, f"{what} exited {done.returncode}\n{out}"
    assert SUCCESS.search(done.stdout), f"{what} printed no 'ok: ' line\n{out}"


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.stem)
def test_example_runs_under_the_launcher(path: Path, tmp_path):
    n = nproc(path)
    done = _launch(path, n, tmp_path)
    _check(done, f"shardwise run --nproc {n} examples/{path.name}")


def test_pipeline_gpt_runs_plainly_starting_its_own_processes(tmp_path):
    script = EXAMPLES / "pipeline_gpt.py"
    done = procs.run([str(script), "--steps", "2"], _env(), tmp_path, timeout=TIMEOUT)
    _check(done, f"{sys.executable} examples/pipeline_gpt.py")


def _launch(path: Path, n: int, cwd: Path):
    return procs.run(["-m", "shardwise", "run", "--nproc", str(n), str(path)], _env(), cwd,
                     timeout=TIMEOUT)


def test_the_fsdp2_example_trains_as_with_torchs_fully_shard(tmp_path):
    """The README's FSDP2 block with torch's ``fully_shard`` in place of ours: the same losses.
    (torch fails the block's earlier form the same two ways: no ``reset_parameters`` on the
    user's model, and a float32 root under bf16 blocks without ``mp_policy`` on the root.)"""
    ours = EXAMPLES / "fsdp2.py"
    line = "from shardwise import FSDPModule, MixedPrecisionPolicy, fully_shard"
    text = ours.read_text()
    assert line in text
    theirs = tmp_path / "fsdp2_torch.py"
    theirs.write_text(text.replace(line, line.replace("shardwise", "torch.distributed.fsdp")))
    losses = {}
    for name, path in (("ours", ours), ("torch's", theirs)):
        done = _launch(path, 2, tmp_path)
        _check(done, f"examples/fsdp2.py with {name} fully_shard")
        losses[name] = [float(v) for v in re.findall(r"rank 0 loss ([\d.]+)", done.stdout)]
    assert len(losses["ours"]) == 10, losses
    assert losses["ours"] == pytest.approx(losses["torch's"], rel=1e-3), losses
