"""A pool of persistent rank processes per world size, reused across tests.

Spawning a process and importing torch costs seconds; a suite of hundreds of distributed tests
cannot pay that per test on two cores. Each pool starts its ranks once (from procs.context():
see [Note: test processes] in procs.py), initialises a gloo default group over a TCPStore
hosted by the test process (port picked by the OS), then runs one test body after another.
Any failure or timeout tears the pool down so that no later test inherits a group left
mid-collective. Before each body, a rank resets the module-level state that would otherwise
carry from one test to the next (state.py), so each test sees the process as new.

Messages go through the pipes as plain pickles, so tensors travel by value: multiprocessing's
own pickler would hand each tensor over as a shared-memory file descriptor that the test process
holds for as long as the tensor lives, and tests that cache ranks' results (a module's saved
states) held over a thousand of them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from tests.harness import procs
from tests.harness.state import reset_module_state

WORLD_SIZES = (1, 2, 4)
TEST_TIMEOUT_S = float(os.environ.get("SHARDWISE_TEST_TIMEOUT", "120"))
GROUP_TIMEOUT_S = float(os.environ.get("SHARDWISE_TEST_GROUP_TIMEOUT", "60"))
FAILURE_GRACE_S = 2.0  # how long the other ranks get to report once one rank failed


class RankFailure(AssertionError):
    """A rank raised inside a test body; the message carries every failing rank's traceback."""


class TestTimeout(AssertionError):
    """Not every rank finished the test body within the timeout."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class RankContext:
    """What a test body gets: this rank's place in the world and the world group."""

    rank: int
    world_size: int

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD


def _send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _worker_main(rank: int, world_size: int, port: int, conn: Connection) -> None:
    import torch

    torch.set_num_threads(1)
    from shardwise.distributed import init

    init("gloo", rank=rank, world_size=world_size, master_port=port, timeout=GROUP_TIMEOUT_S,
         store=dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                             timeout=_td(GROUP_TIMEOUT_S)))
    ctx = RankContext(rank, world_size)
    _send(conn, ("ready", None))
    while True:
        job = _recv(conn)
        if job is None:
            break
        fn, args, kwargs = job
        try:
            reset_module_state()
            _send(conn, ("ok", fn(ctx, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test process
            _send(conn, ("error", traceback.format_exc()))
    dist.destroy_process_group()


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                   wait_for_workers=False)
        self.conns: list[Connection] = []
        self.processes = []
        ctx = procs.context()
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main,
                                      args=(rank, world_size, self.store.port, child),
                                      daemon=True, name=f"shardwise-test-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(proc)
        self._collect("ready", timeout=GROUP_TIMEOUT_S + 30)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for conn in self.conns:
            _send(conn, (fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sentinels = {self.processes[r].sentinel: r for r in pending}
            ready = wait(list(pending.values()) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank in pending and not pending[rank].poll():
                        code = self.processes[rank].exitcode
                        errors[rank] = f"rank {rank} process died (exit code {code})"
                        pending.pop(rank)
                    continue
                rank = next(r for r, c in pending.items() if c is obj)
                self._receive(rank, pending.pop(rank), results, errors)
            if errors:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if errors:
            raise RankFailure(self._describe(what, errors, pending))
        if pending:
            raise TestTimeout(
                f"{what}: ranks {sorted(pending)} of world size {self.world_size} did not finish "
                f"within {timeout:g} s (ranks {sorted(results)} did)"
            )
        return [results[r] for r in range(self.world_size)]

    @staticmethod
    def _receive(rank: int, conn: Connection, results: dict, errors: dict) -> None:
        try:
            status, payload = _recv(conn)
        except EOFError:
            errors[rank] = f"rank {rank} closed its pipe (process died)"
            return
        if status == "error":
            errors[rank] = payload
        else:
            results[rank] = payload

    def _describe(self, what: str, errors: dict[int, str], pending: dict) -> str:
        parts = [f"{what} failed on rank(s) {sorted(errors)} of world size {self.world_size}"]
        if pending:
            parts.append(f"(ranks {sorted(pending)} were still running and were stopped)")
        for rank in sorted(errors):
            parts.append(f"\n--- rank {rank} ---\n{errors[rank].rstrip()}")
        return "\n".join(parts)

    def close(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    _send(conn, None)
            for proc in self.processes:
                proc.join(timeout=5)
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


_pools: dict[int, _Pool] = {}


def run_on_ranks(world_size: int, fn: Callable, *args: Any, timeout: float | None = None,
                 **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every rank of a gloo world; return each rank's result.

    ``fn`` must be importable (defined at module level). Raises ``RankFailure`` with the
    tracebacks of failing ranks, or ``TestTimeout`` when a rank does not finish in ``timeout``
    seconds; either way every rank of that pool is killed and the next call starts a new one.
    """
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, TEST_TIMEOUT_S if timeout is None else timeout)
    except BaseException:
        _pools.pop(world_size, None)
        pool.close(graceful=False)
        raise


def shutdown_pools() -> None:
    """Stop every pool's ranks (called at the end of the session)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close(graceful=True)


atexit.register(shutdown_pools)
