"""What `shardwise plan --simulate` reports: per plan row, the simulated rank's figures.

Each row of the plan (ddp, zero1, zero2, fsdp, hsdp, fsdp x tpT) maps to a ``DryRun`` of
step.py; ``simulated(result)`` is the ``"simulated"`` object that row gains in ``--json``:
bytes of parameters, gradients, optimizer state and model state the rank holds, the peak of
gathered FSDP units, bytes sent per collective kind and the number of collectives, all for
one training step of the simulated rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from torch import nn

from shardwise.memory.peak import peak_memory_bytes
from shardwise.sim.checkpoint_plan import Reshard, format_checkpoint, simulate_checkpoint
from shardwise.sim.fake_group import SimulationError
from shardwise.sim.step import DryRun, StepResult, simulate_step


def dry_run_for(row: str, world_size: int, *, rank: int = 0, replicas: int = 1,
                precision: str = "fp32", local_world_size: int | None = None,
                tp_plan: Callable | None = None, zero_partition: str = "parameters"
                ) -> DryRun | None:
    """The dry run of a plan row by its name; None for a layout that is not simulated (a 3D
    hsdp x tp mesh, or fsdp x tp without the model's tensor-parallel plan). ``zero_partition``
    is the zero1 and zero2 rows' ``ZeroRedundancyOptimizer(partition=...)``."""
    common = {"world_size": world_size, "rank": rank, "precision": precision,
              "local_world_size": local_world_size}
    if row in ("zero1", "zero2"):
        return DryRun(row, zero_partition=zero_partition, **common)
    if row in ("ddp", "fsdp"):
        return DryRun(row, **common)
    if row == "hsdp":
        return DryRun("hsdp", replicas=replicas, **common)
    if row.startswith("fsdp x tp") and tp_plan is not None:  # no plan: not simulated
        return DryRun("fsdp", tp=int(row.removeprefix("fsdp x tp")), tp_plan=tp_plan,
                      **common)
    return None


def simulated(result: StepResult) -> dict:
    state = result.state
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer,
            "model_state": state.total, "peak_gathered": result.peak_gathered,
            "sent_bytes": dict(result.sent_bytes), "collectives": result.collectives}


def simulate_rows(build: Callable[[], nn.Module], runs: Sequence[DryRun | None],
                  reshard: Reshard | None = None) -> tuple[list[dict | None], dict]:
    """Run each dry run in turn (one fake world at a time); returns the ``"simulated"`` objects
    (None where a row is not simulated) and the ``"simulation"`` record: seconds and the
    process's peak resident memory. With ``reshard``, each simulated object also holds
    ``"checkpoint"``: the checkpoint plan of sim/checkpoint_plan.py, saved at the row's world
    and loaded at ``reshard``'s."""
    start = time.perf_counter()
    for run in runs:  # every load's layout is checked (DryRun) before any dry run starts
        if run is not None and reshard is not None:
            replace(run, world_size=reshard.world_size, rank=reshard.rank)
    out = []
    for run in runs:
        if run is None:
            out.append(None)
            continue
        after = None if reshard is None else simulate_checkpoint(build, run, reshard)
        result = simulate_step(build, run, after=after)
        out.append({**simulated(result), **result.extra})
    return out, {"seconds": round(time.perf_counter() - start, 3),
                 "peak_rss_bytes": peak_memory_bytes()}


def format_simulated(record: dict, scale: float, units: str) -> list[str]:
    """The table's lines for the simulated figures of ``record``'s rows."""
    sim = record["simulation"]
    lines = [f"simulated: rank {record['simulated_rank']} of {record['world_size']}, one "
             f"training step on the fake process group ({sim['seconds']:.1f} s, peak RSS "
             f"{sim['peak_rss_bytes'] / 2**30:.2f} GiB); {units} per rank"]
    for row in record["rows"]:
        s = row.get("simulated")
        if s is None:
            continue
        sent = ", ".join(f"{k} {v / scale:.3g}" for k, v in s["sent_bytes"].items()) or "none"
        lines.append(f"  {row['strategy']:<12} state {s['model_state'] / scale:.3g} "
                     f"(params {s['params'] / scale:.3g}, grads {s['grads'] / scale:.3g}, "
                     f"optimizer {s['optimizer'] / scale:.3g}), peak gathered "
                     f"{s['peak_gathered'] / scale:.3g}; sent: {sent}; "
                     f"{s['collectives']} collectives")
        if row.get("checkpoint"):
            lines += format_checkpoint(row["checkpoint"])
    return lines


__all__ = ["SimulationError", "dry_run_for", "format_simulated", "simulate_rows", "simulated"]
