"""shardwise.rpc against torch.distributed.rpc (TensorPipe) on loopback, in one run.

Two fresh processes per implementation and round (rounds interleave ours and torch's). Worker 0
measures: 1 KB tensor echo round trip (median, p99), 64 MB tensor one way (the callee returns
nothing) and echoed, and rpc_async calls per second with many in flight. Prints each figure
with the ratio ours / torch's (latency: lower is better; throughput: higher is better).

    python benchmarks/bench_rpc.py [--rounds 2] [--echo 500] [--inflight 2000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time

import torch

MB = 1 << 20


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
    if impl == "shardwise":
        import shardwise.rpc as rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               rpc_timeout=120)
    else:
        import torch.distributed.rpc as rpc

        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               rpc_timeout=120)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--echo", type=int, default=500)
    ap.add_argument("--big", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=2000)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"shardwise": [], "torch": []}
    for _ in range(args.rounds):
        for impl in ("shardwise", "torch"):
            runs[impl].append(run_once(impl, args))
    print(json.dumps(runs, indent=1), file=sys.stderr)
    print(f"{'figure':<22}{'shardwise':>12}{'torch':>12}{'ratio':>8}")
    for key in runs["shardwise"][0]:
        ours = statistics.median(r[key] for r in runs["shardwise"])
        theirs = statistics.median(r[key] for r in runs["torch"])
        print(f"{key:<22}{ours:>12.1f}{theirs:>12.1f}{ours / theirs:>8.2f}")


if __name__ == "__main__":
    main()
