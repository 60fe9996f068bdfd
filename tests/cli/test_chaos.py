"""Chaos: `shardwise train --strategy fsdp --max-restarts 3` with a rank killed (SIGKILL) at three
random steps ends with the uninterrupted run's final loss, losing at most one checkpoint interval
of steps per kill.

The killer is this test: it reads the job's output (the launcher's own lines and the ranks'
relayed ones, merged in the order the launcher wrote them), and when rank 0 reports the drawn
step it SIGKILLs the drawn rank, found by the RANK in the environment of the launcher's children.
The steps and ranks come from a seeded generator and are printed, so a failure can be replayed.
The time from each kill to the first step of the restarted group is printed too (run with -s);
docs/launcher.md quotes it.
"""

import dataclasses
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli.test_train import TINY
from tests.harness import run_on_ranks

pytestmark = pytest.mark.slow  # minutes of launchers and restarts: `pytest -m slow`

SEED = 11
STEPS, EVERY, KILLS = 60, 10, 3
MODEL = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
         "--batch-size", "8", "--lr", "0.003", "--warmup", "5", "--eval-batches", "1",
         "--corpus-bytes", "400000", "--no-progress", "--log-every", "1"]
STEP_LINE = re.compile(r"\[rank0\]: step (\d+)/\d+ loss (\S+)$")
RESUMED = re.compile(r"\[rank0\]: resumed from \S+step_(\d+) at step")
RESTARTING = re.compile(r"shardwise: restarting every rank \(restart (\d+) of 3\)")


@dataclasses.dataclass
class Kill:
    step: int  # kill when rank 0 reports this step (or a later one) ...
    rank: int  # ... by SIGKILL to this rank
    seen: int = 0  # the step rank 0 had reported when the kill was sent
    reached: int = 0  # the last step the killed group completed (its last report)
    sent: float = 0.0
    restarted: float | None = None  # seconds from the kill to the launcher's restart line
    training: float | None = None  # seconds from the kill to the restarted group's first step


def _plan(seed: int) -> list[Kill]:
    """One kill in each third of the run, after the first checkpoint, so that all three happen
    (a restart resumes at or before the step it was killed at, so each target is reached)."""
    rng = random.Random(seed)
    bounds = [(EVERY + 1, 24), (26, 39), (41, STEPS - 3)]
    return [Kill(rng.randint(lo, hi), rng.randrange(2)) for lo, hi in bounds]


def _rank_pid(launcher: int, rank: int) -> int:
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    for pid in map(int, children.stdout.split()):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no child of the launcher runs rank {rank}")


def _reference(ctx, cfg):
    from shardwise.cli.train_loop import train

    return train(cfg, ctx.group, torch.device("cpu")).losses


def _run_with_kills(ck: Path, kills: list[Kill]) -> tuple[int, list[str]]:
    cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", "2", "--strategy", "fsdp",
           "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--max-restarts", "3",
           "--checkpoint-dir", str(ck), "--grace-seconds", "5", *MODEL]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, pending, last = [], list(kills), None
    try:
        for line in job.stdout:
            now = time.monotonic()
            line = line.rstrip("\n")
            lines.append(line)
            if last is not None and last.restarted is None and RESTARTING.match(line):
                last.restarted = now - last.sent
            step = STEP_LINE.match(line)
            if not step:
                continue
            if last is not None and last.restarted is None:
                last.reached = int(step[1])  # reports read late, or the step under way
            if last is not None and last.restarted is not None and last.training is None:
                last.training = now - last.sent  # the restarted group's first step
            if pending and (last is None or last.training is not None) and \
                    int(step[1]) >= pending[0].step:
                last = pending.pop(0)
                last.seen = last.reached = int(step[1])
                last.sent = time.monotonic()
                os.kill(_rank_pid(job.pid, last.rank), signal.SIGKILL)
        return job.wait(timeout=120), lines
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_three_kills_under_max_restarts_end_with_the_uninterrupted_final_loss(tmp_path):
    kills = _plan(SEED)
    print(f"\nchaos seed {SEED}: kill " +
          ", ".join(f"rank {k.rank} at step {k.step}" for k in kills))
    code, lines = _run_with_kills(tmp_path / "ck", kills)
    log = "\n".join(lines)
    assert code == 0, log
    assert all(k.training is not None for k in kills), log
    assert [int(m[1]) for m in map(RESTARTING.match, lines) if m] == [1, 2, 3], log
    assert log.count("was killed by SIGKILL") == KILLS, log

    # each restart resumed from a checkpoint at most one interval behind the step reached
    resumed = [int(m[1]) for m in map(RESUMED.match, lines) if m]
    assert len(resumed) == KILLS, log
    for kill, at in zip(kills, resumed):
        assert kill.reached - EVERY <= at <= kill.reached, (kill, at)

    # every step any attempt reported, the final one included, is the uninterrupted run's
    cfg = dataclasses.replace(TINY, steps=STEPS, strategy="fsdp", eval_batches=1)
    expected = run_on_ranks(2, _reference, cfg)[0]
    reported = [(int(m[1]), float(m[2])) for m in map(STEP_LINE.match, lines) if m]
    assert reported[-1][0] == STEPS
    assert reported[-1][1] == pytest.approx(expected[STEPS - 1], abs=1e-6)
    for step, loss in reported:
        assert loss == pytest.approx(expected[step - 1], abs=1e-6), step

    for n, kill in enumerate(kills, 1):
        print(f"kill {n}: rank {kill.rank} at step {kill.reached}, resumed at step "
              f"{resumed[n - 1]}: restart began {kill.restarted:.2f} s and training resumed "
              f"{kill.training:.2f} s after the kill")
    print(f"kill -> training again: median "
          f"{statistics.median(k.training for k in kills):.2f} s")
