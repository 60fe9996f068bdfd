"""worker1 dies in the middle of a call from worker0; run as ``python -m`` by test_failure.

Prints what worker0 saw: the exception type of the pending call (WorkerDied, not a timeout),
of a new call to the dead worker, and what graceful shutdown raised (WorkerDied, promptly).
"""

from __future__ import annotations

import os

import shardwise.rpc as rpc
from tests.harness import procs
from tests.harness.ports import reserved_port
from tests.rpc import helpers


def victim() -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=os.environ["INIT"], rpc_timeout=30)
    rpc.init_rpc("victim", rank=1, world_size=2, rpc_backend_options=opts)
    helpers.STOP.wait(60)


def main() -> None:
    with reserved_port() as port:  # until this process's store (rank 0) has bound it
        init = f"tcp://127.0.0.1:{port}"
        proc = procs.fork_call(victim, {"INIT": init})  # the victim: a process of its own
        opts = rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=30)
        rpc.init_rpc("survivor", rank=0, world_size=2, rpc_backend_options=opts)
    pending = rpc.rpc_async("victim", helpers.die_soon, args=(0.5,))
    try:
        pending.wait()
        print("pending: returned")
    except Exception as exc:  # noqa: BLE001
        print(f"pending: {type(exc).__name__}: {exc}".splitlines()[0])
    try:
        rpc.rpc_sync("victim", helpers.my_name)
        print("after: returned")
    except Exception as exc:  # noqa: BLE001
        print(f"after: {type(exc).__name__}")
    try:
        rpc.shutdown(graceful=True)  # no time limit: only the peer's death can end the wait
        print("shutdown: returned")
    except Exception as exc:  # noqa: BLE001
        print(f"shutdown: {type(exc).__name__}: {exc}")
    print(f"agent cleared: {rpc.current.maybe_agent() is None}")
    proc.wait(10)


if __name__ == "__main__":
    main()
