"""init_rpc under torchrun, under `shardwise run`, and under two `shardwise run` launchers as
two nodes on loopback: the launcher's store is used (nothing binds MASTER_PORT a second time),
the secret comes without user action on one host, and nothing prints an error line."""

from __future__ import annotations

import os
import sys

import pytest

from tests.harness import procs
from tests.harness.ports import reserved_port
from tests.rpc.conftest import ROOT, python_path

PROGRAM = str(ROOT / "tests" / "rpc" / "launched_program.py")
BAD = ("failed to bind", "error", "traceback", "warning")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=python_path(), OMP_NUM_THREADS="1")
    env.pop("SHARDWISE_RPC_SECRET", None)
    return env


def _check(outputs: list[str], world: int) -> None:
    text = "\n".join(outputs)
    for rank in range(world):
        assert f"rpc ok: rank {rank} -> worker{(rank + 1) % world} = {rank + 1}" in text, text
    bad = [line for line in text.splitlines() if any(b in line.lower() for b in BAD)]
    assert not bad, text


def _run(cmds: list[list[str]]) -> list[str]:
    # each launcher started by tests/harness/procs.py (forked from its server); the
    # ranks they start are fresh interpreters, as always
    programs = [procs.start(c[1:], _env(), ROOT) for c in cmds]
    outs = []
    try:
        for p in programs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in programs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in programs] == [0] * len(programs), "\n".join(outs)
    return outs


def test_init_rpc_under_torchrun():
    _check(_run([[sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node=2", PROGRAM]]), 2)


def test_init_rpc_under_shardwise_run():
    _check(_run([[sys.executable, "-m", "shardwise", "run", "--nproc", "2", PROGRAM]]), 2)


@pytest.mark.slow  # two launchers, four fresh ranks: `pytest -m slow`
def test_init_rpc_under_two_shardwise_run_nodes_on_loopback():
    with reserved_port() as port:  # node 0's launcher binds it
        _check(_run([[sys.executable, "-m", "shardwise", "run", "--nproc", "2", "--nnodes",
                      "2", "--node-rank", str(k), "--rdzv-endpoint", f"127.0.0.1:{port}",
                      PROGRAM] for k in (0, 1)]), 4)
