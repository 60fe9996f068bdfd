"""Loss curves from `shardwise train --log-dir` directories: reading ``metrics.jsonl`` and
drawing one or several runs on one chart (`shardwise plot DIR1 DIR2 ...`)."""

from __future__ import annotations

import json
from pathlib import Path

SIZE_PX = (900, 500)
_DPI = 100


class MetricsError(ValueError):
    """A directory without a readable metrics file; the message names it."""


def read_metrics(log_dir: str | Path) -> list[dict]:
    """The rows of ``log_dir/metrics.jsonl``; a resumed run's later rows win for a step."""
    path = Path(log_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise MetricsError(f"{log_dir}: no metrics file {path.name} "
                           f"({exc.strerror or exc}); is it a --log-dir of shardwise train?"
                           ) from None
    by_step: dict[int, dict] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise MetricsError(f"{path}:{number} is not a metrics row") from None
    return [by_step[s] for s in sorted(by_step)]


def draw_loss_curves(runs: dict[str, list[dict]], path: str | Path,
                     title: str = "training loss") -> None:
    """Loss against step, one line per run (legend: the run's name), and tokens/s beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI),
                                            dpi=_DPI, gridspec_kw={"width_ratios": [2, 1]})
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        loss_ax.plot(steps, [r["loss"] for r in rows], label=name, linewidth=1.2)
        speed = [(r["step"], r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")]
        if speed:
            speed_ax.plot(*zip(*speed), label=name, linewidth=0.8)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (mean over ranks, nats per token)")
    loss_ax.set_title(title)
    speed_ax.set_xlabel("step")
    speed_ax.set_ylabel("throughput (tokens/s)")
    speed_ax.set_title("throughput")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
