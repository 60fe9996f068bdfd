"""Plain c10d all-gather / reduce-scatter against shardwise's fast equivalents, side by side.

Each measurement issues the collective on a flat fp32 buffer (default 32 MiB full size, the
unsharded parameters of one large block) and waits for it; the plain and fast methods alternate
call by call so that machine noise falls on both. Each round runs in fresh ranks. Reports the
median per method (a call's time is its slowest rank's), each round's median, and the ratio
fast / plain of the same collective. Peak memory is not reported: both methods run in one
process.

    shardwise bench collectives --nproc 2 --mib 32 --iters 15 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from shardwise.distributed.env import str_var
from shardwise.dp.buckets import MIB

CASES = ("all_gather", "reduce_scatter")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardwise.distributed as sd
    from shardwise.dp.fast_collectives import all_gather_flat, reduce_scatter_flat

    torch.set_num_threads(1)
    group = sd.init("gloo")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = args.mib * MIB // 4 // world
    full, shard, space = torch.randn(world * n), torch.randn(n), torch.empty(world * n)
    calls = {
        "all_gather": lambda impl: all_gather_flat(full, shard, group, impl=impl),
        # a training loop reduces the same sizes every step, so it keeps one workspace
        "reduce_scatter": lambda impl: reduce_scatter_flat(shard, full, group, impl=impl,
                                                           workspace=space),
    }
    times: dict[str, list[float]] = {f"{c}/{i}": [] for c in CASES for i in ("plain", "fast")}
    for it in range(args.iters + 2):
        for case in CASES:
            for impl in ("plain", "fast"):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                calls[case](impl)
                if it >= 2:
                    times[f"{case}/{impl}"].append(time.perf_counter() - t0)
    Path(f"{args.worker_out}.rank{rank}.json").write_text(json.dumps(times))
    sd.destroy()


def run(argv: Sequence[str]) -> dict | None:
    """Parent: every round in fresh ranks, then the record; worker: one rank's timings."""
    parser = argparse.ArgumentParser(prog="shardwise bench collectives", description=DESCRIPTION)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mib", type=int, default=32, help="full buffer size in MiB")
    parser.add_argument("--iters", type=int, default=15, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None,
                        help="directory for the JSON record and the PNG plot")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv))
    for flag in ("nproc", "mib", "iters", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.worker_out:
        _worker(args)
        return None
    from shardwise.launch import launch

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            out = f"{tmp}/coll.{rnd}"
            code = launch(args.nproc, [sys.executable, "-m", "shardwise.bench", "collectives",
                                       *argv, "--worker-out", out])
            if code:
                raise SystemExit(f"benchmark ranks failed in round {rnd} (exit code {code})")
            rounds.append([json.loads(Path(f"{out}.rank{r}.json").read_text())
                           for r in range(args.nproc)])
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "worker_out")}
    settings["omp_threads"] = str_var("OMP_NUM_THREADS", "1 (set by the worker)")
    return {"bench": "collectives", "description": DESCRIPTION, "settings": settings,
            "baseline": "plain (of the same collective)", "time_label": "time per call",
            "impls": _summary(rounds)}


def _summary(rounds: list[list[dict]]) -> dict:
    impls = {}
    for case in CASES:
        for impl in ("plain", "fast"):
            key = f"{case}/{impl}"
            per_round = [[max(ts) for ts in zip(*(r[key] for r in rnd))] for rnd in rounds]
            impls[key] = {
                "median_step_s": statistics.median(t for calls in per_round for t in calls),
                "round_median_step_s": [statistics.median(calls) for calls in per_round],
                "peak_rss_mib": None, "round_peak_rss_mib": None, "extra": {},
            }
        for impl in ("plain", "fast"):
            impls[f"{case}/{impl}"]["ratio"] = (impls[f"{case}/{impl}"]["median_step_s"]
                                                / impls[f"{case}/plain"]["median_step_s"])
    return impls


DESCRIPTION = "plain c10d all-gather / reduce-scatter against shardwise's fast equivalents"
