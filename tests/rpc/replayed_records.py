"""Replayed store records (issue 46 point 2): two RPC workers meeting at a store the test
hosts (as a launcher does), while the test, as an outsider, pins the group id and copies in
signed records of another job or of the workers' earlier ``init_rpc``.

``python -m tests.rpc.replayed_records`` runs one rank. ``REPLAY_MODE``: ``clean`` (one
``init_rpc``, nothing waited for), ``job`` (rank 1 joins only once the outsider says it has
pinned and replayed: file ``pinned``), ``reinit`` (a first ``init_rpc`` with one call and a
shutdown, then as ``job``). In the replayed group, rank 0 serves and calls ``shutdown()`` at
once (a parameter server); rank 1 calls rank 0 ``CALLS`` times, then shuts down. Both print
``key: value`` lines for the test.

With ``REPLAY_EVERY_READ=1`` (mode ``reinit``), rank 0 meets its second group through
:class:`OutsiderWinsEveryRace`: rank 1's shutdown record there is overwritten with its record
of the first group just before each of rank 0's reads, as an outsider writing it in a loop
would manage at best.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise.rpc as rpc
from shardwise.rpc import rendezvous

CALLS = 20


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class OutsiderWinsEveryRace(dist.Store):
    """``inner`` as rank 0 sees it while an outsider copies the first group's
    ``shutdown/1`` over the second group's right before every read of it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.first, self.second = f"{rendezvous.PREFIX}/0/", f"{rendezvous.PREFIX}/1/"

    def get(self, key: str) -> bytes:
        if key == self.second + "shutdown/1" and self.inner.check([self.first + "shutdown/1"]):
            self.inner.set(key, self.inner.get(self.first + "shutdown/1"))
        return self.inner.get(key)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout=None) -> None:
        self.inner.wait(keys)


def _init(rank: int, world: int, store: dist.Store | None = None) -> None:
    wait = float(os.environ.get("CONNECT_TIMEOUT", "60"))
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30, connect_timeout=wait, store=store)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)


def _first_group(rank: int, world: int, store: dist.Store | None) -> None:
    _init(rank, world, store)
    if rank == 1:
        rpc.rpc_sync("worker0", torch.add, args=(torch.tensor(1), 1))
    rpc.shutdown()
    print("first group: done", flush=True)


def _calls() -> int:
    ok = 0
    try:
        for i in range(CALLS):
            ok += rpc.rpc_sync("worker0", torch.add, args=(torch.tensor(i), 1)).item() == i + 1
            time.sleep(0.02)
    except Exception as exc:  # noqa: BLE001 - printed for the test
        print(f"call error: {type(exc).__name__}: {exc}")
    return ok


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where, mode = Path(os.environ["SCENARIO_DIR"]), os.environ["REPLAY_MODE"]
    torch.set_num_threads(1)
    store = None
    if os.environ.get("REPLAY_EVERY_READ") == "1" and rank == 0:
        store = OutsiderWinsEveryRace(rendezvous.make_store("env://", rank, world, 60))
    if mode == "reinit":
        _first_group(rank, world, store)
    if rank == 1 and mode != "clean":
        _wait_for(where / "pinned")
    _init(rank, world, store)
    if rank == 1:
        print(f"calls ok: {_calls()}")
        (where / "calls_done").touch()
    try:
        rpc.shutdown()
        print("shutdown: returned")
    except Exception as exc:  # noqa: BLE001 - printed for the test
        print(f"shutdown: {type(exc).__name__}: {exc}")
    if rank == 0:
        print(f"rank 1 done before rank 0 left: {(where / 'calls_done').exists()}")


if __name__ == "__main__":
    main()
