"""Shared-memory channel programs for test_shm: ``python -m tests.rpc.shm_scenario MODE``.

``clean``: two workers exchange large tensors both ways and shut down gracefully.
``kill``: the callee dies (``os._exit``) while large tensors are on their way in both
directions and a call is pending. Rank 0 prints ``key: value`` lines: the channel, the
connection's segment prefix, what the pending calls raised and how long that took, and the
segments under the prefix that exist once both processes are gone.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import shardwise.rpc as rpc
from shardwise.rpc.current import get_agent
from shardwise.rpc.wire import shm_ring
from tests.harness import procs
from tests.harness.ports import reserved_port
from tests.rpc import helpers

TIMEOUT = 30.0


def callee() -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=os.environ["INIT"], rpc_timeout=TIMEOUT)
    rpc.init_rpc("callee", rank=1, world_size=2, rpc_backend_options=opts)
    if os.environ["MODE"] == "clean":
        rpc.shutdown(graceful=True)
    else:
        helpers.STOP.wait(60)


def main(mode: str) -> None:
    with reserved_port() as port:  # until this process's store (rank 0) has bound it
        init = f"tcp://127.0.0.1:{port}"
        proc = procs.fork_call(callee, {"INIT": init, "MODE": mode})  # the callee: a process
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=TIMEOUT)
        rpc.init_rpc("caller", rank=0, world_size=2, rpc_backend_options=opts)
    conn = get_agent().transport.conns[1]
    print(f"channel: {type(conn).__name__}")
    prefix = conn.link.prefix
    print(f"prefix: {prefix}")
    big = torch.randn(4 << 20)  # 16 MB: a segment per message
    if mode == "clean":
        got = [rpc.rpc_async("callee", helpers.identity, args=(big * i,)) for i in range(4)]
        print(f"echoed: {all(torch.equal(f.wait(), big * i) for i, f in enumerate(got))}")
        rpc.shutdown(graceful=True)
    else:
        flood = [rpc.rpc_async("callee", helpers.identity, args=(big,)) for _ in range(6)]
        t0 = time.monotonic()
        pending = rpc.rpc_async("callee", helpers.die_soon, args=(0.05,))
        flood += [rpc.rpc_async("callee", helpers.identity, args=(big,)) for _ in range(6)]
        errors = set()
        for fut in [pending, *flood]:
            try:
                fut.wait()
            except Exception as exc:  # noqa: BLE001
                errors.add(type(exc).__name__)
        print(f"pending: {pending.done()} {sorted(errors)}")
        print(f"failed within timeout: {time.monotonic() - t0 < TIMEOUT}")
        try:
            rpc.shutdown(graceful=True)
        except Exception as exc:  # noqa: BLE001
            print(f"shutdown: {type(exc).__name__}")
    proc.wait(30)
    print(f"callee exit: {proc.returncode}")
    print(f"left: {shm_ring.leftover(prefix)}")


if __name__ == "__main__":
    main(sys.argv[1])
