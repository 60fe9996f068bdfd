"""``rank_table``: a group's global ranks, held as a ``range`` when they are evenly spaced (so
FSDP's per-unit copy does not grow with the world), equal to ``global_ranks`` in every case.
Played on the fake process group (one process, rank 3 of 8; see [Note: simulated ranks])."""

from __future__ import annotations

import torch.distributed as dist

from shardwise.distributed.groups import global_ranks, rank_table
from shardwise.sim.fake_group import fake_world


def test_even_groups_are_ranges_and_uneven_ones_lists():
    with fake_world(8, rank=3) as world:
        strided = dist.new_group([1, 3, 5, 7])
        uneven = dist.new_group([0, 3, 4])
        single = dist.new_group([3])
        assert rank_table(world) == range(8) and rank_table(None) == range(8)
        assert rank_table(strided) == range(1, 9, 2)
        assert rank_table(single) == range(3, 4)
        assert rank_table(uneven) == [0, 3, 4]
        for group in (world, strided, uneven, single):
            assert list(rank_table(group)) == global_ranks(group)
