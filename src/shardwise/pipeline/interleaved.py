"""Interleaved 1F1B: several stages per rank (stage k on rank k % size), with torch's name
``ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=..., scale_grads=True)``.

A rank holding v stages of a p-rank pipeline (num_stages = v * p) runs its forwards in blocks of
``per_round`` micro-batches (per_round = n / max(1, n // p)): a block through its first stage,
the same block through its second stage, ..., then the next block. Its first
``(v - 1) * per_round + 2 * (p - 1 - rank)`` actions are forwards (warm-up, capped at v * n);
then it alternates one forward and one backward, the backwards going through its stages in the
reverse order, a block at a time; then the remaining backwards. Each stage holds 1/v of the
layers, so with equal stage times the fill and drain cost (p - 1) short stage times instead of
(p - 1) long ones: the idle fraction falls from (p - 1) / (n + p - 1) towards
(p - 1) / (v * n + p - 1) (``simulated_bubble`` gives the exact figure of these orders).

``interleaved_order`` is a pure function of (rank, ranks, stages per rank, micro-batches);
``simulate`` runs every rank's order against the pipeline's dependencies (a forward needs the
previous stage's forward of that micro-batch, a backward the next stage's backward) and fails on
an order that would deadlock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.pipeline.schedules import StageAction, _Schedule
from shardwise.pipeline.stage import PipelineStage


def rounds_of(n_microbatches: int, ranks: int) -> tuple[int, int]:
    """(rounds, micro-batches per round): one round per ``ranks`` micro-batches (at least one);
    the rounds must split the micro-batches evenly."""
    rounds = max(1, n_microbatches // ranks)
    if n_microbatches % rounds:
        raise ValueError(f"interleaved 1F1B runs the micro-batches in {rounds} equal rounds "
                         f"({ranks} ranks), which {n_microbatches} micro-batches do not fill; "
                         f"use a multiple of {rounds}")
    return rounds, n_microbatches // rounds


def interleaved_order(rank: int, ranks: int, local_stages: int,
                      n_microbatches: int) -> list[StageAction]:
    """Rank ``rank``'s actions ("F"/"B", local stage, micro-batch); local stage j is the
    pipeline's stage ``j * ranks + rank``."""
    _, per_round = rounds_of(n_microbatches, ranks)
    total = local_stages * n_microbatches
    warmup = min((local_stages - 1) * per_round + 2 * (ranks - 1 - rank), total)
    next_f, next_b = [0] * local_stages, [0] * local_stages

    def forward(k: int) -> StageAction:
        j = (k // per_round) % local_stages
        next_f[j] += 1
        return ("F", j, next_f[j] - 1)

    def backward(k: int) -> StageAction:
        j = local_stages - 1 - (k // per_round) % local_stages
        next_b[j] += 1
        return ("B", j, next_b[j] - 1)

    order = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [forward(k), backward(k - warmup)]
    return order + [backward(k) for k in range(total - warmup, total)]


def simulate(orders: list[list[StageAction]], forward_s: float = 1.0,
             backward_s: float = 2.0) -> tuple[float, list[float]]:
    """Run every rank's order with fixed action times and free communication: (the step's
    length, each rank's busy time). RuntimeError when no rank can go on (a deadlock)."""
    ranks = len(orders)
    num_stages = ranks * max((j for o in orders for _, j, _ in o), default=0) + ranks
    done: dict[tuple[str, int, int], float] = {}
    pos, clock, busy = [0] * ranks, [0.0] * ranks, [0.0] * ranks
    while any(pos[r] < len(orders[r]) for r in range(ranks)):
        moved = False
        for r in range(ranks):
            while pos[r] < len(orders[r]):
                kind, j, i = orders[r][pos[r]]
                s = j * ranks + r
                need = ("F", s - 1, i) if kind == "F" else ("B", s + 1, i)
                if kind == "B" and s == num_stages - 1:
                    need = ("F", s, i)
                ready = 0.0 if kind == "F" and s == 0 else done.get(need)
                if ready is None:
                    break
                took = forward_s if kind == "F" else backward_s
                clock[r] = max(clock[r], ready) + took
                busy[r] += took
                done[(kind, s, i)] = clock[r]
                pos[r], moved = pos[r] + 1, True
        if not moved:
            raise RuntimeError(f"the orders deadlock at positions {pos}")
    return max(clock), busy


def simulated_bubble(ranks: int, local_stages: int, n_microbatches: int) -> float:
    """The mean idle fraction of the interleaved orders with equal stage times (a backward
    twice a forward, communication free); ``local_stages=1`` gives 1F1B's."""
    orders = [interleaved_order(r, ranks, local_stages, n_microbatches) for r in range(ranks)]
    length, busy = simulate(orders, 1.0 / local_stages, 2.0 / local_stages)
    return 1 - sum(busy) / (ranks * length)


class ScheduleInterleaved1F1B(_Schedule):
    """Interleaved 1F1B over this rank's ``stages`` (stage k of the pipeline on rank
    k % size, every rank the same number of stages; any order in the list). Trains: needs a
    ``loss_fn``; ``eval`` runs forwards only. The rank whose stages include stage 0 passes the
    batch to ``step``, the one with the last stage ``target=`` (and ``losses=``). Over either
    transport; the messages are the stages' own (p2p.py, rpc_transport.py)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 scale_grads: bool = True):
        stages = _check_stages(stages)
        self._init(stages, n_microbatches, loss_fn, scale_grads)
        if loss_fn is None:
            raise ValueError("ScheduleInterleaved1F1B trains: it needs a loss_fn (use its eval "
                             "for forwards only)")
        self._ranks = dist.get_world_size(stages[0].group)
        self._rank = stages[0].stage_index % self._ranks
        rounds_of(n_microbatches, self._ranks)

    def _actions(self) -> list[StageAction]:
        return interleaved_order(self._rank, self._ranks, len(self._stages), self._n)


def _check_stages(stages: list[PipelineStage]) -> list[PipelineStage]:
    if not isinstance(stages, (list, tuple)) or not stages:
        raise TypeError("ScheduleInterleaved1F1B takes a non-empty list of this rank's "
                        "PipelineStages")
    for s in stages:
        if not isinstance(s, PipelineStage):
            raise TypeError(f"a schedule runs a PipelineStage, got {type(s).__name__}")
    stages = sorted(stages, key=lambda s: s.stage_index)
    first = stages[0]
    size = dist.get_world_size(first.group)
    for s in stages[1:]:
        if (s.group, s.num_stages, s.transport) != (first.group, first.num_stages,
                                                    first.transport):
            raise ValueError("the stages of one interleaved schedule share their group, "
                             "num_stages and transport")
    expected = list(range(first.stage_index % size, first.num_stages, size))
    got = [s.stage_index for s in stages]
    if got != expected:
        raise ValueError(f"this rank holds stages {expected} of {first.num_stages}; the "
                         f"schedule got stages {got}")
    return stages
