"""One pool of RPC workers for all RPC tests: this process is worker0, two more are started
(``python -m tests.rpc.worker_main``, by tests/harness/procs.py).

Starting a worker costs seconds where it imports torch, so the pool starts once per session
and channel. worker1 and worker2 join through env:// (MASTER_ADDR / MASTER_PORT, as torchrun sets
them); this process joins through tcp:// and hosts the store.

Every RPC test runs once per channel between workers (``rpc_channel``): TCP and shared memory
(shm_channel.py), set through ``SHARDWISE_RPC_CHANNEL``, which the spawned workers and the
scenario programs inherit. Setting that variable before pytest starts runs one channel only.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pytest

import shardwise.rpc as rpc
from shardwise.rpc import rendezvous
from shardwise.rpc.wire.shm_channel import ENV as CHANNEL_ENV
from tests.harness import procs
from tests.harness.ports import reserved_port
from tests.rpc import helpers

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3


def python_path() -> str:
    """The tests' root and this checkout's sources first (not an installed shardwise)."""
    return os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"),
                                       os.environ.get("PYTHONPATH", "")) if p)


def spawn(module: str, rank: int, world: int, port: int, extra_env=None) -> procs.Program:
    """``python -m module`` as rank ``rank`` of ``world`` (env://, as torchrun sets it)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world), PYTHONPATH=python_path(), OMP_NUM_THREADS="1",
               **(extra_env or {}))
    return procs.start(["-m", module], env, ROOT)


# the default run covers shared memory (what `auto` picks between workers on one host); TCP, the
# channel between hosts, runs with the slow tests (`pytest -m slow`, CI)
CHANNELS = [os.environ[CHANNEL_ENV]] if os.environ.get(CHANNEL_ENV) else [
    pytest.param("tcp", marks=pytest.mark.slow), "shm"]


@pytest.fixture(scope="session", params=CHANNELS, autouse=True)
def rpc_channel(request):
    """The channel every RPC connection of the test uses (``tcp`` or ``shm``), forced."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHANNEL_ENV, request.param)
        yield request.param


@pytest.fixture(scope="session")
def rpc_world(rpc_channel):
    """Names of the pool's workers; this process is ``worker0``."""
    with pytest.MonkeyPatch.context() as patch:
        yield from _world(patch)


def _world(patch: pytest.MonkeyPatch):
    with reserved_port() as port:  # bound by this process's store, in init_rpc below
        yield from _world_on(patch, port)


def _world_on(patch: pytest.MonkeyPatch, port: int):
    # A fresh store and fresh workers: this process's next init_rpc is their first too, so
    # its keys must go under the first call's prefix (rendezvous.scoped), as theirs do.
    patch.setattr(rendezvous, "_init_counter", itertools.count())
    workers = [spawn("tests.rpc.worker_main", r, WORLD, port) for r in range(1, WORLD)]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=30, connect_timeout=60)
    try:
        rpc.init_rpc("worker0", rank=0, world_size=WORLD, rpc_backend_options=opts,
                     allowed_modules=[helpers])
    except BaseException:
        for p in workers:
            p.kill()
        raise
    yield [f"worker{r}" for r in range(WORLD)]
    for r in range(1, WORLD):
        rpc.rpc_async(f"worker{r}", helpers.stop)
    rpc.shutdown(graceful=True, timeout=20)
    for p in workers:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def program_starts(monkeypatch) -> list:
    """Every way to a shell or a new program (``os.system``, ``exec*``, ``spawn*``, ``fork``,
    ``subprocess.Popen``) records the attempt and raises instead of running; the list of
    attempts, which a fuzz test asserts stays empty."""
    calls: list = []

    def record(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"code execution attempted: {args!r:.100}")

    for name in ("system", "popen", "execv", "execve", "execvp", "spawnv", "posix_spawn",
                 "fork"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, record)
    monkeypatch.setattr(subprocess, "Popen", record)
    return calls
