"""One pool of RPC workers for all RPC tests: this process is worker0, two more are spawned.

Spawning a worker costs seconds (importing torch), so the pool starts once per session.
worker1 and worker2 join through env:// (MASTER_ADDR / MASTER_PORT, as torchrun sets them);
this process joins through tcp:// and hosts the store.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise.rpc as rpc
from tests.rpc import helpers

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_path() -> str:
    """The tests' root and this checkout's sources first (not an installed shardwise)."""
    return os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"),
                                       os.environ.get("PYTHONPATH", "")) if p)


def spawn(module: str, rank: int, world: int, port: int, extra_env=None) -> subprocess.Popen:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world), PYTHONPATH=python_path(), OMP_NUM_THREADS="1",
               **(extra_env or {}))
    return subprocess.Popen([sys.executable, "-m", module], env=env, cwd=ROOT)


@pytest.fixture(scope="session")
def rpc_world():
    """Names of the pool's workers; this process is ``worker0``."""
    port = free_port()
    procs = [spawn("tests.rpc.worker_main", r, WORLD, port) for r in range(1, WORLD)]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=30, connect_timeout=60)
    try:
        rpc.init_rpc("worker0", rank=0, world_size=WORLD, rpc_backend_options=opts,
                     allowed_modules=[helpers])
    except BaseException:
        for p in procs:
            p.kill()
        raise
    yield [f"worker{r}" for r in range(WORLD)]
    for r in range(1, WORLD):
        rpc.rpc_async(f"worker{r}", helpers.stop)
    rpc.shutdown(graceful=True, timeout=20)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
