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
communication left exposed after backward; one with ``limit_rows`` (row -> its ``local-*`` row)
gets it from the local row's step plus the ``pattern_comm_ms`` that row measured; a row that
reports ``limit_compute_ms`` brings its own (``limit_figures``; the record's ``limits``; what
each strategy cannot overlap: limits.py).

``--device cuda`` runs the ranks on CUDA devices with NCCL (one device per rank; the world size
defaults to the number of devices), and adds each rank's CUDA peak memory and, on the local row,
how much an all-reduce overlaps computation on one device's streams (cuda_overlap.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.distributed.env import child_environment, str_var
from shardwise.launch.launcher import THP_VAR, huge_pages_on_request

MIB = 1 << 20


@dataclass(frozen=True)
class SideBySide:
    """One side-by-side benchmark: its implementations and what each rank runs."""

    name: str
    worker: Callable
    impls: Sequence[str]
    baseline: str
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    description: str = ""
    limit_of: str | None = None
    # row -> the local row whose step and ``pattern_comm_ms`` make that row's limit
    limit_rows: Mapping[str, str] = field(default_factory=dict)
    pattern: str = ""  # what the strategy's pattern cannot overlap (the limit's communication)
    cuda: bool = True  # whether ``--device cuda`` is supported


def common_parser(bench_name: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"shardwise bench {bench_name}",
                                     description=description or None)
    parser.add_argument("--nproc", type=int, default=None,
                        help="world size (default: 2 on CPU, the number of CUDA devices)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one CUDA device per rank, NCCL")
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
    if args.nproc is None:
        args.nproc = cuda_device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and not args.worker and args.nproc > cuda_device_count():
        parser.error(f"--nproc {args.nproc} is more than the {cuda_device_count()} CUDA "
                     "device(s) present")
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


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bench_device(args: argparse.Namespace):
    """The torch device this rank computes on: ``cpu``, or its CUDA device."""
    import torch

    if getattr(args, "device", "cpu") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run(bench: SideBySide, argv: Sequence[str]) -> dict | None:
    """Parent: run every round and return the record. Worker (``--worker``): run one rank,
    write its JSON and return None."""
    args = parse(bench, argv)
    if args.worker:
        _run_worker(bench, args)
        return None
    chosen = args.only.split(",") if args.only else list(bench.impls)
    return _run_parent(bench, args, list(argv), chosen)


def _run_worker(bench: SideBySide, args: argparse.Namespace) -> None:
    import torch

    import shardwise.distributed as sd
    from shardwise.distributed.env import int_var
    from shardwise.memory import peak_memory_bytes

    torch.set_num_threads(int_var("OMP_NUM_THREADS", 1, minimum=1))
    group = sd.init(backend="nccl" if args.device == "cuda" else "gloo")
    rank = torch.distributed.get_rank(group)
    times, extra = bench.worker(args.worker, args, group)
    if args.device == "cuda":
        from shardwise.bench.cuda_overlap import cuda_figures

        extra = {**extra, **cuda_figures(group, overlap=args.worker in _locals(bench))}
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


def _locals(bench: SideBySide) -> set[str]:
    return {r for r in (bench.limit_of, *bench.limit_rows.values()) if r}


def _run_parent(bench: SideBySide, args: argparse.Namespace, argv: list[str],
                impls: list[str]) -> dict:
    """Every round of every implementation in fresh ranks. A row whose ranks fail is left out
    of later rounds and of the summary, and named in the record's ``failed``."""
    from shardwise.bench.records import run_meta
    from shardwise.launch import launch

    env = child_environment()
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    records: dict[str, list[list[dict]]] = {impl: [] for impl in impls}
    failed: dict[str, str] = {}
    command = [sys.executable, "-m", "shardwise.bench", bench.name]
    meta = run_meta(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for impl in [i for i in impls if i not in failed]:
                out = f"{tmp}/{impl}.{rnd}"
                code = launch(args.nproc, [*command, *argv, "--worker", impl,
                                           "--worker-out", out], env=env)
                if code:
                    failed[impl] = f"exit code {code} in round {rnd}"
                    print(f"shardwise bench: {impl} failed ({failed[impl]}); left out",
                          file=sys.stderr)
                    continue
                records[impl].append([json.loads(Path(f"{out}.rank{r}.json").read_text())
                                      for r in range(args.nproc)])
    meta["load_after"] = run_meta(args.device)["load_before"]
    done = {impl: rounds for impl, rounds in records.items() if impl not in failed}
    if not done:
        raise SystemExit(f"every implementation failed: {failed}")
    record = {"bench": bench.name, "description": bench.description, "meta": meta,
              "settings": _settings(args), "baseline": bench.baseline,
              "impls": summarise(done, bench.baseline)}
    if failed:
        record["failed"] = failed
    limits = limit_figures(record["impls"], bench.limit_of, bench.limit_rows, bench.pattern)
    if limits["impls"]:
        record["limits"] = limits
    return record


def _settings(args: argparse.Namespace) -> dict:
    hidden = {"worker", "worker_out", "out"}
    settings = {k: v for k, v in vars(args).items() if k not in hidden}
    settings["omp_threads"] = str_var("OMP_NUM_THREADS", "cores // nproc (launcher)")
    huge = "1 (launcher)" if huge_pages_on_request() else "unset (kernel: never)"
    settings["thp_mem_alloc"] = str_var(THP_VAR, huge)
    return settings


_MEDIAN_OVER_ROUNDS = ("exposed_comm_ms", "pattern_comm_ms", "limit_compute_ms")


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
        for key in _MEDIAN_OVER_ROUNDS:  # the limit's parts: rank 0's, median over rounds
            values = [rnd[0][key] for rnd in rounds if key in rnd[0]]
            if values:
                summary[impl]["extra"][key] = round(statistics.median(values), 2)
    base = summary.get(baseline, {}).get("median_step_s")
    for impl in summary:
        summary[impl]["ratio"] = summary[impl]["median_step_s"] / base if base else None
    return summary


def limit_figures(summary: dict, local: str | None = None,
                  rows: Mapping[str, str] | None = None, pattern: str = "") -> dict:
    """The physical limit of each row that has one, and step / limit. A row's limit is its
    computation without communication plus the communication its pattern cannot overlap:

    - a row reporting ``limit_compute_ms`` and ``exposed_comm_ms`` (pipeline) brings both;
    - a row reporting only ``exposed_comm_ms`` (our DDP / ZeRO bucketer's wait at the end of
      backward) adds it to ``local``'s median step;
    - a row named in ``rows`` adds the ``pattern_comm_ms`` its local row measured to that local
      row's median step.
    """
    out: dict = {"local": local, "pattern": pattern, "impls": {}}
    if local in summary:
        out["local_step_ms"] = summary[local]["median_step_s"] * 1000
    for impl, s in summary.items():
        figures = _limit_parts(impl, s, summary, local, rows or {})
        if figures is None:
            continue
        compute, exposed, source = figures
        limit = compute + exposed
        out["impls"][impl] = {"compute_ms": compute, "exposed_comm_ms": exposed,
                              "limit_ms": limit, "from": source,
                              "step_over_limit": s["median_step_s"] * 1000 / limit}
    return out


def _limit_parts(impl: str, s: dict, summary: dict, local: str | None,
                 rows: Mapping[str, str]) -> tuple[float, float, str] | None:
    extra = s["extra"]
    if "limit_compute_ms" in extra and "exposed_comm_ms" in extra:
        return extra["limit_compute_ms"], extra["exposed_comm_ms"], impl
    if "exposed_comm_ms" in extra and local in summary:
        return summary[local]["median_step_s"] * 1000, extra["exposed_comm_ms"], local
    own = rows.get(impl)
    if own in summary and "pattern_comm_ms" in summary[own]["extra"]:
        return (summary[own]["median_step_s"] * 1000, summary[own]["extra"]["pattern_comm_ms"],
                own)
    return None
