"""Run a framework program on 2 ranks, once per implementation (torch, shardwise).

The test process hosts the c10d store on a port the kernel picks (port 0) and each rank,
started by tests/harness/procs.py as ``python -m MODULE IMPL OUT_DIR`` with a launcher's
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joins it as a client
(``TORCHELASTIC_USE_AGENT_STORE=True``, as under torchrun's agent): no port is guessed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness import procs

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("torch", "shardwise")


def run_program(module: str, impl: str, out_dir: Path, world: int = 2,
                timeout: float = 300) -> list[dict]:
    """Run every rank of ``module`` with ``impl``; returns each rank's saved results."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"),
                                                     os.environ.get("PYTHONPATH", "")) if p),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
    programs = [procs.start(["-m", module, impl, str(out_dir)],
                            dict(env, RANK=str(r), LOCAL_RANK=str(r)), ROOT)
                for r in range(world)]
    outputs = []
    try:
        for p in programs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in programs:
            if p.poll() is None:
                p.kill()
        del store
    failed = [out for p, out in zip(programs, outputs) if p.returncode != 0]
    assert not failed, f"{impl} run of {module} failed:\n" + "\n".join(failed)
    return [torch.load(out_dir / f"{impl}_rank{r}.pt", weights_only=True) for r in range(world)]


def run_both(module: str, out_dir: Path, kind: str = "") -> dict:
    """``{impl: per-rank results}`` for torch's run and shardwise's; ``kind`` (a prefix of
    IMPL, ``kind-impl``) picks one of several programs in the module."""
    prefix = f"{kind}-" if kind else ""
    return {impl: run_program(module, prefix + impl, out_dir) for impl in IMPLS}
