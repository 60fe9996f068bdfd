"""Where a 1 KB ``rpc_sync`` echo's round trip goes, hop by hop (ours, one host).

Two processes on 127.0.0.1 (env:// rendezvous); rank 0 calls ``echo`` on rank 1 1,000 times
after 300 warm-up calls. Both stamp ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, one clock for
the whole host) when a frame is handed to the transport, when a thread reading the connection
receives one and when the call starts, through wrappers around the agent's methods. Printed: the
median of each hop. ``SHARDWISE_RPC_CHANNEL`` picks the channel (shm or tcp).

    python benchmarks/rpc_hops.py            # spawns its two ranks
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

WARMUP, CALLS = 300, 1000


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _instrument(stamps: dict[str, list[int]]) -> None:
    from shardwise.rpc import agent as agent_mod

    cls = agent_mod.RpcAgent
    on_frame, run_and_reply, request = cls._on_frame, cls._run_and_reply, cls.send_reply

    def stamped(name, fn):
        def wrapper(*args, **kwargs):
            stamps[name].append(time.perf_counter_ns())
            return fn(*args, **kwargs)
        return wrapper

    cls._on_frame = stamped("recv", on_frame)
    cls._run_and_reply = stamped("run", run_and_reply)
    cls.send_reply = stamped("reply", request)


def rank_main(rank: int, out: str) -> None:
    import shardwise.rpc as rpc

    stamps: dict[str, list[int]] = {"recv": [], "run": [], "reply": []}
    _instrument(stamps)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)  # __main__ is allowed
    starts, ends = [], []
    if rank == 0:
        x = torch.ones(256)  # 1 KB
        for _ in range(WARMUP):
            rpc.rpc_sync("w1", echo, args=(x,))
        for values in stamps.values():
            values.clear()
        for _ in range(CALLS):
            starts.append(time.perf_counter_ns())
            rpc.rpc_sync("w1", echo, args=(x,))
            ends.append(time.perf_counter_ns())
    rpc.shutdown()
    with open(out, "w") as f:
        json.dump({"starts": starts, "ends": ends, **stamps}, f)


def _within(times: list[int], lo: int, hi: int, last: bool) -> int:
    inside = [t for t in times if lo <= t <= hi]
    return inside[-1] if last else inside[0]


def _align(caller: dict, callee: dict) -> list[tuple[int, ...]]:
    """Per call: (start, callee recv, callee run, callee reply, caller recv, end). One clock for
    the host, so each call's stamps are the ones inside its [start, end] window."""
    rows = []
    for start, end in zip(caller["starts"], caller["ends"]):
        run = _within(callee["run"], start, end, last=False)
        rows.append((start, _within(callee["recv"], start, run, last=True), run,
                     _within(callee["reply"], run, end, last=False),
                     _within(caller["recv"], start, end, last=True), end))
    return rows


def _report(caller: dict, callee: dict) -> None:
    rows = _align(caller, callee)
    names = ["caller: call -> callee's reader has the frame",
             "callee: reader has the frame -> the call starts",
             "callee: run the call",
             "reply: encode, send -> caller's reader has it",
             "caller: reader -> rpc_sync returns"]
    print(f"channel {os.environ.get('SHARDWISE_RPC_CHANNEL', 'auto')}, {CALLS} calls, "
          f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; median per hop (us):")
    for k, name in enumerate(names):
        print(f"  {name:50s} {statistics.median(r[k + 1] - r[k] for r in rows) / 1e3:8.1f}")
    total = statistics.median(r[-1] - r[0] for r in rows) / 1e3
    print(f"  {'total round trip':50s} {total:8.1f}")


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) == 3:
        rank_main(int(sys.argv[1]), sys.argv[2])
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE="2", OMP_NUM_THREADS="1")
        outs = [os.path.join(tmp, f"r{r}.json") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, __file__, str(r), outs[r]],
                                  env=dict(env, RANK=str(r))) for r in range(2)]
        if any(p.wait(timeout=300) for p in procs):
            raise SystemExit("a rank failed")
        caller, callee = (_load(o) for o in outs)
    _report(caller, callee)


if __name__ == "__main__":
    main()
