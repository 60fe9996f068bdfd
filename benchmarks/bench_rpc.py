"""shardwise.rpc over TCP and over shared memory against torch.distributed.rpc (TensorPipe).

Two fresh processes on this host per implementation and round, joined through env://
(MASTER_ADDR / MASTER_PORT) with default options; rounds interleave the three: ours with
``SHARDWISE_RPC_CHANNEL=tcp``, ours with ``=shm``, torch's. Worker 0 measures: 1 KB tensor
echo round trip with rpc_sync (median, p99), a 64 MB tensor one way (the callee returns
nothing) and echoed, and rpc_async calls per second with many in flight. Prints torch's
figures (median over rounds) and ours beside them with the ratio ours / torch's (latency:
lower is better; throughput: higher is better), the bar each figure has to meet, and the load
average before and after (figures from a loaded machine are not figures).

    python benchmarks/bench_rpc.py [--rounds 3] [--echo 500] [--big 5] [--inflight 2000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import torch

MB = 1 << 20
IMPLS = ("shardwise-tcp", "shardwise-shm", "torch")
# figure: (bar for ours / torch's, True if higher is better); None: no bar
BARS = {"lat_med_us": (0.8, False), "lat_p99_us": None, "oneway_GBps": (1.5, True),
        "echo_GBps": (1.5, True), "async_calls_per_s": (1.0, True)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def echo(t):
    return t


def sink(t):
    return None


def _measure(rpc, args) -> dict:
    small = torch.randn(256)  # 1 KB
    for _ in range(50):
        rpc.rpc_sync("w1", echo, args=(small,))
    lat = []
    for _ in range(args.echo):
        t0 = time.perf_counter()
        rpc.rpc_sync("w1", echo, args=(small,))
        lat.append(time.perf_counter() - t0)
    lat.sort()
    big = torch.randn(64 * MB // 4)
    rpc.rpc_sync("w1", sink, args=(big,))
    one, both = [], []
    for _ in range(args.big):
        t0 = time.perf_counter()
        rpc.rpc_sync("w1", sink, args=(big,))
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rpc.rpc_sync("w1", echo, args=(big,))
        both.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    futs = [rpc.rpc_async("w1", echo, args=(small,)) for _ in range(args.inflight)]
    for f in futs:
        f.wait()
    calls = args.inflight / (time.perf_counter() - t0)
    return {"lat_med_us": statistics.median(lat) * 1e6,
            "lat_p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e6,
            "oneway_GBps": 64 * MB / statistics.median(one) / 1e9,
            "echo_GBps": 2 * 64 * MB / statistics.median(both) / 1e9,
            "async_calls_per_s": calls}


def _worker(impl: str, rank: int, port: int, args, q) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if impl.startswith("shardwise"):
        os.environ["SHARDWISE_RPC_CHANNEL"] = impl.split("-")[1]
        import shardwise.rpc as rpc
    else:
        import torch.distributed.rpc as rpc
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        q.put(_measure(rpc, args))
    rpc.shutdown()


def run_once(impl: str, args) -> dict:
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_worker, args=(impl, r, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + \
        f" on {os.cpu_count()} CPUs"


def _bar(key: str, ratio: float) -> str:
    if BARS[key] is None:
        return ""
    limit, higher = BARS[key]
    met = ratio >= limit if higher else ratio <= limit
    return f"{'>=' if higher else '<='}{limit:g} {'met' if met else 'NOT met'}"


def report(runs: dict[str, list[dict]]) -> None:
    med = {impl: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for impl, rs in runs.items()}
    print(f"{'figure':<19}{'torch':>10}{'ours tcp':>10}{'ratio':>7}{'ours shm':>10}{'ratio':>7}"
          "  bar (shm / torch)")
    for key, theirs in med["torch"].items():
        tcp, shm = med["shardwise-tcp"][key], med["shardwise-shm"][key]
        print(f"{key:<19}{theirs:>10.2f}{tcp:>10.2f}{tcp / theirs:>7.2f}{shm:>10.2f}"
              f"{shm / theirs:>7.2f}  {_bar(key, shm / theirs)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--echo", type=int, default=500)
    ap.add_argument("--big", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=2000)
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    args = ap.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    if any(i not in IMPLS for i in impls):
        ap.error(f"--impls takes {', '.join(IMPLS)}")
    print(f"before: {_load()}", flush=True)
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            runs[impl].append(run_once(impl, args))
    print(json.dumps(runs, indent=1), file=sys.stderr)
    print(f"after: {_load()}; {args.rounds} interleaved rounds, medians over rounds")
    if set(impls) == set(IMPLS):
        report(runs)
    else:
        for impl, rs in runs.items():
            print(impl, {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]})


if __name__ == "__main__":
    main()
