"""Run several implementations of one training step side by side and compare them.

Each (implementation, round) runs in fresh ranks started by shardwise's launcher, so peak RSS per
rank belongs to one implementation alone; rounds interleave the implementations (A B A B ...) so
that load from elsewhere on the machine falls on all of them alike. Each rank times every step
(forward, backward, optimizer step, zero_grad) after a warm-up and writes a JSON record; the
parent reports the median step time of each implementation, ratios against a baseline, and the
peak RSS and model-state bytes per rank.

A benchmark script calls ``main(worker, impls, baseline)`` where ``worker(impl, args, group)``
runs on every rank and returns ``(step_times_seconds, extra_dict)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

MIB = 1024 * 1024


def parse(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--only", default=None, help="comma-separated implementations to run")
    parser.add_argument("--mmap-threshold", action="store_true",
                        help="set MALLOC_MMAP_THRESHOLD_=131072 so freed blocks return to the "
                             "OS and peak RSS tracks live memory (wall times include page faults)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    if extra:
        extra(parser)
    return parser.parse_args()


def main(worker: Callable, impls: Sequence[str], baseline: str,
         extra: Callable[[argparse.ArgumentParser], None] | None = None,
         limit_of: str | None = None) -> dict:
    """``limit_of``: an implementation without communication (each rank's world-size-1 step);
    rows reporting ``exposed_comm_ms`` are then also compared with that step plus their
    exposed communication, the physical limit of overlapping communication with backward."""
    args = parse(extra)
    if args.worker:
        _run_worker(worker, args)
        return {}
    chosen = args.only.split(",") if args.only else list(impls)
    summary = _run_parent(args, chosen, baseline)
    if limit_of in summary:
        print(format_limits(summary, limit_of))
    return summary


def _run_worker(worker: Callable, args: argparse.Namespace) -> None:
    import torch

    import shardwise.distributed as sd
    from shardwise.memory import peak_memory_bytes

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group = sd.init()
    rank = torch.distributed.get_rank(group)
    times, extra = worker(args.worker, args, group)
    record = {"rank": rank, "times": times, "peak_rss_mib": peak_memory_bytes() / MIB, **extra}
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(record))
    sd.destroy()


def _run_parent(args: argparse.Namespace, impls: list[str], baseline: str) -> dict:
    from shardwise.distributed import launch

    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    records: dict[str, list[dict]] = {impl: [] for impl in impls}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for impl in impls:
                out = f"{tmp}/{impl}.{rnd}"
                argv = [sys.executable, sys.argv[0], *sys.argv[1:], "--worker", impl, "--out", out]
                code = launch(args.nproc, argv, env=env)
                if code:
                    raise SystemExit(f"{impl} failed in round {rnd} (exit code {code})")
                records[impl] += [json.loads(Path(f"{out}.rank{r}.json").read_text())
                                  for r in range(args.nproc)]
    summary = summarise(records, baseline, args.nproc)
    print(format_table(summary, args))
    return summary


def summarise(records: dict[str, list[dict]], baseline: str, nproc: int) -> dict:
    """Median step time per implementation; a step's time is its slowest rank's time."""
    summary = {}
    for impl, recs in records.items():
        rounds = [recs[i : i + nproc] for i in range(0, len(recs), nproc)]
        steps = [max(ts) for rnd in rounds for ts in zip(*(r["times"] for r in rnd))]
        summary[impl] = {
            "median_step_s": statistics.median(steps),
            "peak_rss_mib": [max(r["peak_rss_mib"] for r in recs if r["rank"] == k)
                             for k in range(nproc)],
            "extra": {k: v for k, v in recs[0].items()
                      if k not in ("rank", "times", "peak_rss_mib")},
        }
    base = summary.get(baseline, {}).get("median_step_s")
    for impl in summary:
        summary[impl]["ratio"] = summary[impl]["median_step_s"] / base if base else None
    return summary


def format_limits(summary: dict, local: str) -> str:
    """Each row with an ``exposed_comm_ms`` against ``local``'s step + that communication."""
    base = summary[local]["median_step_s"] * 1000
    lines = [f"physical limit = {local} step ({base:.1f} ms) + the row's exposed communication"]
    for impl, s in summary.items():
        exposed = s["extra"].get("exposed_comm_ms")
        if exposed is None:
            continue
        limit = base + exposed
        step = s["median_step_s"] * 1000
        lines.append(f"{impl:<28}limit {limit:>9.1f} ms   step/limit {step / limit:.3f}")
    return "\n".join(lines)


def format_table(summary: dict, args: argparse.Namespace) -> str:
    lines = [f"world size {args.nproc}, {args.rounds} rounds x {args.steps} timed steps "
             f"(after {args.warmup} warm-up), OMP threads per rank "
             f"{os.environ.get('OMP_NUM_THREADS', 'cores // nproc (launcher)')}",
             f"{'implementation':<28}{'median step (ms)':>18}{'ratio':>8}  peak RSS per rank (MiB)"]
    for impl, s in summary.items():
        ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "-"
        rss = " / ".join(f"{m:.0f}" for m in s["peak_rss_mib"])
        lines.append(f"{impl:<28}{s['median_step_s'] * 1000:>18.1f}{ratio:>8}  {rss}")
        if s["extra"]:
            lines.append(f"{'':<28}{json.dumps(s['extra'])}")
    return "\n".join(lines)
