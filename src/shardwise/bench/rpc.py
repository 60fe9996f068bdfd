"""shardwise.rpc over TCP and over shared memory against torch.distributed.rpc (TensorPipe).

Two fresh processes on this host per implementation and round, joined through env://
(MASTER_ADDR / MASTER_PORT) with default options; rounds interleave the three: ours with
``SHARDWISE_RPC_CHANNEL=tcp``, ours with ``=shm``, torch's. Worker 0 measures: 1 KB tensor
echo round trip with rpc_sync (median, p99), a 64 MB tensor one way (the callee returns
nothing) and echoed, and rpc_async calls per second with many in flight. Prints torch's
figures (median over rounds) and ours beside them with the ratio ours / torch's (latency:
lower is better; throughput: higher is better), the bar each figure has to meet, and the load
average before and after (figures from a loaded machine are not figures). The shared-memory
channel is measured where this install has it.

    shardwise bench rpc [--rounds 3] [--echo 500] [--big 5] [--inflight 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Sequence

import torch

from shardwise.distributed.env import AGENT_STORE_VAR

MB = 1 << 20
IMPLS = ("shardwise-tcp", "shardwise-shm", "torch")
# figure -> its unit, whether higher is better, and the bar for ours / torch's (None: no bar)
FIGURES = {
    "lat_med_us": {"label": "1 KB echo, median", "unit": "us", "higher_is_better": False,
                   "bar": 0.8},
    "lat_p99_us": {"label": "1 KB echo, p99", "unit": "us", "higher_is_better": False,
                   "bar": None},
    "oneway_GBps": {"label": "large tensor one way", "unit": "GB/s", "higher_is_better": True,
                    "bar": 1.5},
    "echo_GBps": {"label": "large tensor echoed", "unit": "GB/s", "higher_is_better": True,
                  "bar": 1.5},
    "async_calls_per_s": {"label": "rpc_async, many in flight", "unit": "calls/s",
                          "higher_is_better": True, "bar": 1.0},
}


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
    big = torch.randn(args.big_mb * MB // 4)
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
            "oneway_GBps": args.big_mb * MB / statistics.median(one) / 1e9,
            "echo_GBps": 2 * args.big_mb * MB / statistics.median(both) / 1e9,
            "async_calls_per_s": calls}


def _worker(impl: str, rank: int, port: int, args, q) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # This pair's store is its rank 0's. Under a launcher (the bench run as a launched rank)
    # this process inherits TORCHELASTIC_USE_AGENT_STORE, which tells both RPC libraries that
    # the launcher hosts the store: no rank would host it, and the pair would wait for nothing.
    os.environ.pop(AGENT_STORE_VAR, None)
    kwargs = {}
    if impl.startswith("shardwise"):
        os.environ["SHARDWISE_RPC_CHANNEL"] = impl.split("-")[1]
        import shardwise.rpc as rpc

        kwargs["allowed_modules"] = [__name__]  # echo and sink, by shardwise's allow-list
    else:
        import torch.distributed.rpc as rpc
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, **kwargs)
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
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def available_impls() -> tuple[str, ...]:
    """The implementations this install has (the shared-memory channel is newer than TCP)."""
    has_shm = importlib.util.find_spec("shardwise.rpc.wire.shm_channel") is not None
    return tuple(i for i in IMPLS if i != "shardwise-shm" or has_shm)


def run(argv: Sequence[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shardwise bench rpc", description=DESCRIPTION)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--echo", type=int, default=500, help="1 KB round trips timed")
    ap.add_argument("--big", type=int, default=5, help="large transfers timed each way")
    ap.add_argument("--big-mb", type=int, default=64, help="size of a large transfer (MB)")
    ap.add_argument("--inflight", type=int, default=2000, help="rpc_async calls in flight")
    ap.add_argument("--impls", default=",".join(available_impls()),
                    help="comma-separated subset")
    ap.add_argument("--out", default=None, help="directory for the JSON record and the PNG")
    args = ap.parse_args(list(argv))
    impls = [i for i in args.impls.split(",") if i]
    if not impls or any(i not in available_impls() for i in impls):
        ap.error(f"--impls takes {', '.join(available_impls())}")
    for flag in ("rounds", "echo", "big", "big_mb", "inflight"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    load_before = _load()
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            runs[impl].append(run_once(impl, args))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(nproc=2, load_before=load_before, load_after=_load())
    return {"bench": "rpc", "description": DESCRIPTION, "kind": "figures",
            "settings": settings, "baseline": "torch", "figures": FIGURES,
            "impls": _summary(runs)}


def _summary(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for impl, rounds in runs.items():
        out[impl] = {"figures": {k: statistics.median(r[k] for r in rounds) for k in FIGURES},
                     "round_figures": {k: [r[k] for r in rounds] for k in FIGURES}}
    base = out.get("torch")
    for summary in out.values():
        summary["ratio"] = ({k: summary["figures"][k] / base["figures"][k] for k in FIGURES}
                            if base else None)
    return out


DESCRIPTION = "shardwise.rpc (TCP, shared memory) against torch.distributed.rpc (TensorPipe)"
