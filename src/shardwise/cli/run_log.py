"""`shardwise train --log-dir DIR`: a record of the run that a person can watch and compare.

Rank 0 writes, in ``DIR``:

- ``metrics.jsonl``: one JSON object per step: ``step`` (1-based, steps done), ``loss`` (the mean
  over ranks, the number the run prints), ``lr``, ``tokens_per_s`` (global tokens of the step
  over its wall time), ``peak_mib`` (peak memory of each rank so far, MiB: CUDA's max allocated
  or peak RSS), ``time_s`` (seconds since training started) and ``wall_time`` (Unix time). A
  resumed run appends to the same file.
- ``loss.png``: the loss curve, redrawn at every checkpoint and at the end.
- TensorBoard event files (``events.out.tfevents.*``) with the same scalars, when the
  ``tensorboard`` package is installed (``pip install shardwise[tensorboard]``); without it,
  nothing is written for TensorBoard and nothing fails.

The per-rank peak memory costs one small all-gather per step, made only when ``--log-dir`` is
set (every rank calls it; only rank 0 writes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.dp.buckets import MIB
from shardwise.memory import peak_memory_bytes

METRICS_FILE = "metrics.jsonl"
LOSS_PNG = "loss.png"


class RunLog:
    """Every rank makes one; rank 0 writes the files. A step's ``tokens_per_s`` counts the time
    since the previous step was recorded, less a checkpoint and redrawing (``plot``) between."""

    def __init__(self, log_dir: str, group: dist.ProcessGroup, device: torch.device):
        self.dir = Path(log_dir)
        self.group, self.device = group, device
        self.writer = dist.get_rank(group) == 0
        self.start = time.perf_counter()
        self.last = self.start
        self._metrics = None
        self._tb = None
        if self.writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._metrics = (self.dir / METRICS_FILE).open("a")
            self._tb = _tensorboard_writer(self.dir)

    def step(self, step: int, loss: float, lr: float, tokens: int) -> None:
        """Record ``step`` (steps done); collective: every rank calls it."""
        now = time.perf_counter()
        peaks = _peak_per_rank(self.group, self.device)
        seconds, self.last = now - self.last, now
        if not self.writer:
            return
        row = {"step": step, "loss": loss, "lr": lr,
               "tokens_per_s": tokens / seconds if seconds > 0 else None,
               "peak_mib": peaks, "time_s": now - self.start, "wall_time": time.time()}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/lr", lr, step)
            if row["tokens_per_s"] is not None:
                self._tb.add_scalar("train/tokens_per_s", row["tokens_per_s"], step)
            for rank, mib in enumerate(peaks):
                self._tb.add_scalar(f"memory/peak_mib_rank{rank}", mib, step)

    def plot(self) -> None:
        """Redraw ``loss.png`` from the metrics file (rank 0; others return)."""
        if not self.writer:
            return
        self._metrics.flush()
        if self._tb is not None:
            self._tb.flush()
        from shardwise.cli.curves import draw_loss_curves, read_metrics

        draw_loss_curves({self.dir.name or str(self.dir): read_metrics(self.dir)},
                         self.dir / LOSS_PNG)
        self.last = time.perf_counter()  # the next step's rate leaves out saving and drawing

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _tensorboard_writer(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: the metrics file and the PNG only
        return None
    return SummaryWriter(log_dir=str(directory))


def _peak_per_rank(group: dist.ProcessGroup, device: torch.device) -> list[float]:
    mine = torch.tensor([peak_memory_bytes(device) / MIB], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [round(t.item(), 1) for t in everyone]
