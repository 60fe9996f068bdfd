"""Forged store records (issue 25 point 5): two RPC workers and, in the test's process, a
local attacker without the group secret that writes the records the workers trust.

``python -m tests.rpc.forged_records`` runs one rank: rank 0 serves and calls ``shutdown()`` at
once (a parameter server); rank 1 waits until the attacker is done, then calls rank 0
``CALLS`` times and shuts down. Both print ``key: value`` lines for the test.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import shardwise.rpc as rpc

CALLS = 20


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = Path(os.environ["SCENARIO_DIR"])
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30, connect_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 1:
        _wait_for(where / "forged")
        ok = 0
        try:
            for i in range(CALLS):
                ok += rpc.rpc_sync("worker0", torch.add, args=(torch.tensor(i), 1)).item() \
                    == i + 1
                time.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - printed for the test
            print(f"call error: {type(exc).__name__}: {exc}")
        print(f"calls ok: {ok}")
        (where / "calls_done").touch()
    shut_down_and_report(rank, where)


def shut_down_and_report(rank: int, where: Path) -> None:
    """``rpc.shutdown()``, printing how it ended; rank 0 also prints whether rank 1 had finished
    its calls (``calls_done`` in ``where``) before rank 0 left."""
    try:
        rpc.shutdown()
        print("shutdown: returned")
    except Exception as exc:  # noqa: BLE001 - printed for the test
        print(f"shutdown: {type(exc).__name__}: {exc}")
    if rank == 0:
        print(f"rank 1 done before rank 0 left: {(where / 'calls_done').exists()}")


if __name__ == "__main__":
    main()
