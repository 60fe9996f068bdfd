"""Run a small multi-process program once per RPC implementation (tests/compat).

A program is a module run as ``python -m MODULE IMPL OUT_DIR``, with IMPL ``torch`` or
``shardwise``; every rank saves what it computed to ``OUT_DIR/IMPL_rank<r>.pt``. Ranks get
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as a launcher sets them (each rank a process of
its own, started by tests/harness/procs.py), or run under torchrun
itself (``torchrun=True``), whose agent then hosts the store on MASTER_PORT.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.harness import procs

IMPLS = ("torch", "shardwise")


def run_program(module: str, impl: str, world: int, out_dir: Path, torchrun: bool = False,
                timeout: float = 180) -> list[dict]:
    """Run every rank of ``module`` with ``impl``; returns each rank's saved results."""
    from tests.harness.ports import reserved_port  # (not in the ranks: pytest)

    with reserved_port() as port:  # MASTER_PORT, until the ranks are done (unused by torchrun)
        return _run_program(module, impl, world, out_dir, torchrun, timeout, port)


def _run_program(module, impl, world, out_dir, torchrun, timeout, port) -> list[dict]:
    from tests.rpc.conftest import ROOT, python_path  # (not in the ranks: pytest)

    env = dict(os.environ, PYTHONPATH=python_path(), OMP_NUM_THREADS="1",
               TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    args = [module, impl, str(out_dir)]
    if torchrun:  # torchrun started by tests/harness/procs.py; its ranks are not
        programs = [procs.start(["-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world}", "-m", *args], env, ROOT)]
    else:  # `python -m module impl out_dir` per rank, started by tests/harness/procs.py
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
        programs = [procs.start(["-m", *args], dict(env, RANK=str(r), LOCAL_RANK=str(r)), ROOT)
                 for r in range(world)]
    outputs = []
    try:
        for p in programs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in programs:
            if p.poll() is None:
                p.kill()
    failed = [(p.args, out) for p, out in zip(programs, outputs) if p.returncode != 0]
    assert not failed, f"{impl} run of {module} failed:\n" + "\n".join(o for _, o in failed)
    return [torch.load(out_dir / f"{impl}_rank{r}.pt", weights_only=True) for r in range(world)]


def run_both(module: str, world: int, out_dir: Path, torchrun: bool = False) -> dict:
    """``{impl: per-rank results}`` for torch's RPC and ours."""
    return {impl: run_program(module, impl, world, out_dir, torchrun) for impl in IMPLS}


def save(out_dir: str, impl: str, rank: int, results: dict) -> None:
    torch.save(results, Path(out_dir) / f"{impl}_rank{rank}.pt")
