"""Plain c10d all-gather / reduce-scatter against shardwise's fast equivalents, side by side.

Each measurement issues the collective on a flat fp32 buffer (default 32 MiB full size, the
unsharded parameters of one large block) and waits for it; the plain and fast methods alternate
call by call so that machine noise falls on both. Prints the median per method and the ratio.

    python benchmarks/bench_collectives.py --nproc 2 --mib 32 --iters 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024 * 1024
CASES = ("all_gather", "reduce_scatter")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardwise.distributed as sd
    from shardwise.distributed.fast_collectives import all_gather_flat, reduce_scatter_flat

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
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(times))
    sd.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mib", type=int, default=32, help="full buffer size in MiB")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out:
        _worker(args)
        return
    from shardwise.distributed import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/coll"
        code = launch(args.nproc, [sys.executable, sys.argv[0], *sys.argv[1:], "--out", out])
        if code:
            raise SystemExit(f"benchmark ranks failed (exit code {code})")
        per_rank = [json.loads(Path(f"{out}.rank{r}.json").read_text())
                    for r in range(args.nproc)]
    print(f"gloo, world size {args.nproc}, {args.mib} MiB fp32 full buffer, "
          f"{args.iters} calls each (a call's time is its slowest rank's)")
    print(f"{'collective':<16}{'plain (ms)':>12}{'fast (ms)':>12}{'fast/plain':>12}")
    for case in CASES:
        med = {impl: statistics.median(max(ts) for ts in zip(*(r[f"{case}/{impl}"]
                                                           for r in per_rank)))
               for impl in ("plain", "fast")}
        print(f"{case:<16}{med['plain'] * 1e3:>12.1f}{med['fast'] * 1e3:>12.1f}"
              f"{med['fast'] / med['plain']:>12.3f}")


if __name__ == "__main__":
    main()
