"""Run several implementations of one training step side by side and compare them.

Each (implementation, round) runs in fresh ranks started by shardwise's launcher, so peak RSS per
rank belongs to one implementation alone; rounds interleave the implementations (A B A B ...) so
that load from elsewhere on the machine falls on all of them alike. Each rank times every step
(forward, backward, optimizer step, zero_grad) after a warm-up and writes a JSON record; the
parent reports the median step time of each implementation, its spread across rounds, ratios
against a baseline, and the peak RSS and model-state bytes per rank.

A benchmark is a ``SideBySide``: ``worker(impl, args, group)`` runs on every rank and returns
``(step_times_seconds, extra_dict)``. The parent returns a record (see records.py) that
`shardwise bench` prints, saves as JSON and plots. A benchmark with ``limit_of`` (an
implementation without communication: each rank's world-size-1 step) also gets the physical
limit of every row whose worker reports ``exposed_comm_ms``: that local step plus the row's
communication left exposed after backward (``limit_figures``; the record's ``limits``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.distributed.env import child_environment, str_var
from shardwise.distributed.grad_buckets import MIB


@dataclass(frozen=True)
class SideBySide:
    """One side-by-side benchmark: its implementations and what each rank runs."""

    name: str
    worker: Callable
    impls: Sequence[str]
    baseline: str
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    description: str = ""
    # how the parent starts a rank of this benchmark (the worker flags are appended)
    command: list[str] = field(default_factory=list)
    limit_of: str | None = None


def common_parser(bench_name: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"shardwise bench {bench_name}",
                                     description=description or None)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--only", default=None, help="comma-separated implementations to run")
    parser.add_argument("--mmap-threshold", action="store_true",
                        help="set MALLOC_MMAP_THRESHOLD_=131072 so freed blocks return to the "
                             "OS and peak RSS tracks live memory (wall times include page faults)")
    parser.add_argument("--out", default=None,
                        help="directory for the JSON record and the PNG plot")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return parser


def parse(bench: SideBySide, argv: Sequence[str]) -> argparse.Namespace:
    parser = common_parser(bench.name, bench.description)
    if bench.add_args:
        bench.add_args(parser)
    args = parser.parse_args(list(argv))
    for flag in ("nproc", "rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.only:
        unknown = [i for i in args.only.split(",") if i not in bench.impls]
        if unknown:
            parser.error(f"--only: unknown implementation(s) {', '.join(unknown)}; "
                         f"{bench.name} has {', '.join(bench.impls)}")
    return args


def run(bench: SideBySide, argv: Sequence[str]) -> dict | None:
    """Parent: run every round and return the record. Worker (``--worker``): run one rank,
    write its JSON and return None."""
    args = parse(bench, argv)
    if args.worker:
        _run_worker(bench.worker, args)
        return None
    chosen = args.only.split(",") if args.only else list(bench.impls)
    return _run_parent(bench, args, list(argv), chosen)


def _run_worker(worker: Callable, args: argparse.Namespace) -> None:
    import torch

    import shardwise.distributed as sd
    from shardwise.distributed.env import int_var
    from shardwise.memory import peak_memory_bytes

    torch.set_num_threads(int_var("OMP_NUM_THREADS", 1, minimum=1))
    group = sd.init()
    rank = torch.distributed.get_rank(group)
    times, extra = worker(args.worker, args, group)
    record = {"rank": rank, "times": times, "peak_rss_mib": peak_memory_bytes() / MIB, **extra}
    Path(f"{args.worker_out}.rank{rank}.json").write_text(json.dumps(record))
    sd.destroy()
    # Rows with a DDP communication hook (futures chained with .then on gloo) sometimes abort
    # in the interpreter's teardown after the group is gone ("terminate called without an
    # active exception"; torch's own DDP with its own allreduce_hook does it too, torchrun
    # without shardwise): the record is written, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_parent(bench: SideBySide, args: argparse.Namespace, argv: list[str],
                impls: list[str]) -> dict:
    from shardwise.launch import launch

    env = child_environment()
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    records: dict[str, list[list[dict]]] = {impl: [] for impl in impls}
    command = bench.command or [sys.executable, "-m", "shardwise.bench", bench.name]
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for impl in impls:
                out = f"{tmp}/{impl}.{rnd}"
                code = launch(args.nproc, [*command, *argv, "--worker", impl,
                                           "--worker-out", out], env=env)
                if code:
                    raise SystemExit(f"{impl} failed in round {rnd} (exit code {code})")
                records[impl].append([json.loads(Path(f"{out}.rank{r}.json").read_text())
                                      for r in range(args.nproc)])
    record = {"bench": bench.name, "description": bench.description,
              "settings": _settings(args), "baseline": bench.baseline,
              "impls": summarise(records, bench.baseline)}
    if bench.limit_of in record["impls"]:
        record["limits"] = limit_figures(record["impls"], bench.limit_of)
    return record


def _settings(args: argparse.Namespace) -> dict:
    hidden = {"worker", "worker_out", "out"}
    settings = {k: v for k, v in vars(args).items() if k not in hidden}
    settings["omp_threads"] = str_var("OMP_NUM_THREADS", "cores // nproc (launcher)")
    return settings


def summarise(records: dict[str, list[list[dict]]], baseline: str) -> dict:
    """Per implementation: the median step time over every round (a step's time is its slowest
    rank's), each round's median, peak RSS per rank (the most over rounds) and each round's
    peak (the most over ranks), the ratio to the baseline, and the workers' extra figures."""
    summary = {}
    for impl, rounds in records.items():
        per_round = [[max(ts) for ts in zip(*(r["times"] for r in rnd))] for rnd in rounds]
        nproc = len(rounds[0])
        summary[impl] = {
            "median_step_s": statistics.median(s for steps in per_round for s in steps),
            "round_median_step_s": [statistics.median(steps) for steps in per_round],
            "peak_rss_mib": [max(rnd[k]["peak_rss_mib"] for rnd in rounds)
                             for k in range(nproc)],
            "round_peak_rss_mib": [max(r["peak_rss_mib"] for r in rnd) for rnd in rounds],
            "extra": {k: v for k, v in rounds[0][0].items()
                      if k not in ("rank", "times", "peak_rss_mib")},
        }
    base = summary.get(baseline, {}).get("median_step_s")
    for impl in summary:
        summary[impl]["ratio"] = summary[impl]["median_step_s"] / base if base else None
    return summary


def limit_figures(summary: dict, local: str) -> dict:
    """The physical limit of each row with an ``exposed_comm_ms``: ``local``'s median step
    (no communication at all) plus that row's exposed communication, and step / limit."""
    base = summary[local]["median_step_s"] * 1000
    rows = {}
    for impl, s in summary.items():
        exposed = s["extra"].get("exposed_comm_ms")
        if exposed is None:
            continue
        limit = base + exposed
        rows[impl] = {"exposed_comm_ms": exposed, "limit_ms": limit,
                      "step_over_limit": s["median_step_s"] * 1000 / limit}
    return {"local": local, "local_step_ms": base, "impls": rows}


def script_main(worker: Callable, impls: Sequence[str], baseline: str,
                extra: Callable[[argparse.ArgumentParser], None] | None = None,
                limit_of: str | None = None) -> dict:
    """For a benchmark script outside the package (``python benchmarks/bench_x.py``): ranks are
    started by running the script again. Prints the table (and with ``--out DIR`` saves the
    record and the plot); returns the per-implementation summary (empty on a worker)."""
    from shardwise.bench.main import _out_flag
    from shardwise.bench.records import format_table, save

    name = Path(sys.argv[0]).stem.removeprefix("bench_")
    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    bench = SideBySide(name, worker, impls, baseline, extra, doc.split("\n")[0].rstrip("."),
                       command=[sys.executable, sys.argv[0]], limit_of=limit_of)
    record = run(bench, sys.argv[1:])
    if record is None:
        return {}
    print(format_table(record))
    out = _out_flag(sys.argv[1:])
    if out:
        path, png = save(record, out)
        print(f"wrote {path} and {png}")
    return record["impls"]
