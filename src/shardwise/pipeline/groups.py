"""Process groups for pipeline x data parallelism on a (dp, pp) grid of ranks.

Global rank ``r`` sits at replica ``r // pp``, stage ``r % pp``: the pipeline group of a replica
is its ``pp`` consecutive ranks, the data-parallel group of a stage the ranks with the same stage
index. Every rank creates every group (``dist.new_group`` is collective over the world), in
the same order, each with a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardwise.distributed.timeouts import as_timedelta


@dataclass(frozen=True)
class PipelineLayout:
    pp_group: dist.ProcessGroup  # this rank's pipeline: its replica's stages
    dp_group: dist.ProcessGroup  # this rank's stage across replicas
    stage_index: int
    replica: int
    pp: int
    dp: int


def layout_ranks(world_size: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(pipelines, data-parallel groups) as lists of global ranks."""
    if pp < 1 or world_size % pp:
        raise ValueError(f"{pp} stages do not divide the world of {world_size} ranks")
    dp = world_size // pp
    pipes = [[d * pp + s for s in range(pp)] for d in range(dp)]
    return pipes, [[d * pp + s for d in range(dp)] for s in range(pp)]


def pipeline_layout(pp: int, timeout: float | None = None) -> PipelineLayout:
    """This rank's groups on the (dp, pp) grid of the world (dp = world size / pp)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pipes, replicas = layout_ranks(world, pp)
    td = as_timedelta(timeout)
    pp_groups = [dist.new_group(r, timeout=td) for r in pipes]
    dp_groups = [dist.new_group(r, timeout=td) for r in replicas]
    return PipelineLayout(pp_groups[rank // pp], dp_groups[rank % pp], rank % pp, rank // pp,
                          pp, world // pp)
