"""The data-parallel core's sharded gradient norm (ZeRO-2, FSDP, FSDP x TP) against one process."""

import math

import pytest
import torch
import torch.distributed as dist

from shardwise.dp.data_parallel import sharded_grad_norm
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

NORMS = (2.0, 1.0, 3.0, math.inf)


def _full(name: str, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(numel, generator=gen) * 3


def _one_group(ctx):
    world, me = ctx.world_size, ctx.rank
    fulls = [_full("a", 8 * world), _full("b", 4 * world), _full("empty", 0)]
    parts = [f.chunk(world)[me] if f.numel() else f for f in fulls]
    for p in NORMS:
        total = sharded_grad_norm(parts, p, ctx.group, torch.device("cpu"))
        expected = torch.linalg.vector_norm(torch.cat(fulls), p)
        assert_rel_close(total, expected, 1e-5, f"norm {p}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_norm_of_disjoint_parts_equals_the_whole(world_size):
    run_on_ranks(world_size, _one_group)


def _two_axes(ctx):
    """A 2x2 mesh: dp pairs {0,1}, {2,3}; tp pairs {0,2}, {1,3}. Tensor A is split over all four
    ranks; tensor B is split over dp and the same on both tp ranks (a replicated parameter)."""
    me = ctx.rank
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = dp_groups[me // 2], tp_groups[me % 2]
    a, b = _full("a", 16), _full("b", 6)
    parts = [a.chunk(4)[me], b.chunk(2)[me % 2]]
    for p in NORMS:
        total = sharded_grad_norm(parts, p, dp, torch.device("cpu"), copies=[1, 2],
                                  second_group=tp)
        expected = torch.linalg.vector_norm(torch.cat([a, b]), p)
        assert_rel_close(total, expected, 1e-5, f"norm {p}")
    with pytest.raises(ValueError, match="copies has 1 entries for 2 gradients"):
        sharded_grad_norm(parts, 2.0, dp, torch.device("cpu"), copies=[1])
    for group in dp_groups + tp_groups:
        dist.destroy_process_group(group)


def test_norm_over_two_mesh_axes_counts_a_replicated_part_once():
    run_on_ranks(4, _two_axes)
