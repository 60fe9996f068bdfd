"""`shardwise train`'s mesh flags: ``--replicas`` (HSDP) and ``--tp`` (FSDP x TP), checked before
any rank starts.

``--strategy hsdp --replicas R`` lays the world out as ``(R, world / R)``: FSDP within each
group of ``world / R`` consecutive ranks, replicated across the R groups; without ``--replicas``
there is one replica per node (``shardwise.distributed.topology.hybrid_mesh_shape``).
``--strategy fsdp --tp T`` lays it out as ``(world / T, T)`` = (dp, tp): the demo GPT is
tensor-parallel over each group of T consecutive ranks and FSDP shards that over dp.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardwise.cli.ranges import COUNT, COUNT0


def add_mesh_args(parser: argparse.ArgumentParser, replicas: int, tp: int) -> None:
    """The two flags, with TrainConfig's defaults (``replicas`` 0: one per node)."""
    add = parser.add_argument
    add("--replicas", type=COUNT0, default=replicas,
        help="hsdp only: replicas of the sharded model (0: one per node)")
    add("--tp", type=COUNT, default=tp,
        help="fsdp only: tensor-parallel degree (FSDP x TP on a (world/T, T) mesh)")


def heads_problem(n_head: int, degree: int, flag: str) -> str | None:
    """Why ``degree`` tensor-parallel ranks cannot split ``n_head`` attention heads, or None.
    The launcher checks it before any rank starts, and each rank again where it shards the
    model (cli/strategy_tp.py), with this one function."""
    if n_head % degree:
        return (f"{flag} {degree} does not divide --n-head {n_head}: every tensor-parallel "
                "rank must hold whole attention heads")
    return None


def mesh_problem(cfg: Any, world_size: int, nnodes: int = 1) -> str | None:
    """The first problem with ``--replicas`` / ``--tp`` for this world, or None."""
    if cfg.replicas < 0:
        return f"--replicas must be at least 1, got {cfg.replicas}"
    if cfg.tp < 1:
        return f"--tp must be at least 1, got {cfg.tp}"
    if cfg.replicas and cfg.strategy != "hsdp":
        return f"--replicas is for --strategy hsdp, not {cfg.strategy}"
    if cfg.tp > 1 and cfg.strategy != "fsdp":
        return (f"--tp is for --strategy fsdp (FSDP x TP), not {cfg.strategy}"
                + (" (use --nproc for the TP degree)" if cfg.strategy == "tp" else ""))
    if cfg.strategy == "hsdp":
        replicas = cfg.replicas or nnodes
        if world_size % replicas:
            return (f"--strategy hsdp: {replicas} replicas do not divide the world size "
                    f"{world_size}: each replica's shard group must hold world / replicas ranks")
    if cfg.strategy == "tp":  # tensor parallel over the whole world
        return heads_problem(cfg.n_head, world_size, "--strategy tp: the world size")
    if cfg.tp > 1:
        if world_size % cfg.tp:
            return f"--tp {cfg.tp} does not divide the world size {world_size}"
        return heads_problem(cfg.n_head, cfg.tp, "--tp")
    return None
