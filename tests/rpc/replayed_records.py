"""Replayed store records (issue 46 point 2): two RPC workers meeting at a store the test
hosts (as a launcher does), while the test, as an outsider, pins the group id and copies in
signed records of another job or of the workers' earlier ``init_rpc``.

``python -m tests.rpc.replayed_records`` runs one rank. ``REPLAY_MODE``: ``clean`` (one
``init_rpc``, nothing waited for), ``job`` (rank 1 joins only once the outsider says it has
pinned and replayed: file ``pinned``), ``reinit`` (a first ``init_rpc`` with one call and a
shutdown, then as ``job``). In the replayed group, rank 0 serves and calls ``shutdown()`` at
once (a parameter server); rank 1 calls rank 0 ``CALLS`` times, then shuts down. Both print
``key: value`` lines for the test.

In the replayed group, rank 0 sees the store through :class:`RankZerosView`, and rank 1
shuts down only once rank 0 has read its shutdown record there (so rank 0 reads the replayed
one). With ``REPLAY_EVERY_READ=1`` (mode ``reinit``), rank 1's shutdown record is overwritten
with its record of the first group just before each of rank 0's reads, as an outsider writing
it in a loop would manage at best.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise.rpc as rpc
from shardwise.rpc import rendezvous
from tests.rpc.forged_records import shut_down_and_report

CALLS = 20


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class RankZerosView(dist.Store):
    """``inner`` as rank 0 of the replayed group sees it (prefix ``group``): the first read of
    rank 1's shutdown record there leaves the file ``read_shutdown_1`` (rank 1 shuts down only
    after it, so rank 0 surely reads what the outsider put there first). With
    ``every_read``, the outsider copies the first group's ``shutdown/1`` over it right before
    every such read."""

    def __init__(self, inner: dist.Store, group: str, where: Path, every_read: bool) -> None:
        super().__init__()
        self.inner, self.where, self.every_read = inner, where, every_read
        self.watched = f"{rendezvous.PREFIX}/{group}/shutdown/1"
        self.source = f"{rendezvous.PREFIX}/0/shutdown/1"

    def get(self, key: str) -> bytes:
        if key == self.watched:
            if self.every_read and self.inner.check([self.source]):
                self.inner.set(key, self.inner.get(self.source))
            value = self.inner.get(key)
            (self.where / "read_shutdown_1").touch()
            return value
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
    if rank == 0 and mode != "clean":
        store = RankZerosView(rendezvous.make_store("env://", rank, world, 60),
                              "1" if mode == "reinit" else "0", where,
                              os.environ.get("REPLAY_EVERY_READ") == "1")
    if mode == "reinit":
        _first_group(rank, world, store)
    if rank == 1 and mode != "clean":
        _wait_for(where / "pinned")
    _init(rank, world, store)
    if rank == 1:
        print(f"calls ok: {_calls()}")
        (where / "calls_done").touch()
        if mode != "clean":
            _wait_for(where / "read_shutdown_1")
    shut_down_and_report(rank, where)


if __name__ == "__main__":
    main()
