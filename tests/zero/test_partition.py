"""The partition math, without processes."""

import itertools
import random

import pytest

from shardwise.zero.partition import (
    chunk_by_bytes,
    global_indices,
    owners,
    partition_params,
    rank_loads,
)


def test_largest_first_balances_bytes():
    # by hand: 8 -> r0, 7 -> r1, 6 -> r2; loads 8/7/6, so 5 -> r2; loads 8/7/11, so 4 -> r1
    part = partition_params([[5, 8, 6, 7, 4]], 3)
    assert part == [[[1]], [[3, 4]], [[0, 2]]]
    assert rank_loads(part, [[5, 8, 6, 7, 4]]) == [(8, 0), (11, 0), (11, 0)]


def test_ties_go_to_the_lowest_rank_and_equal_sizes_keep_index_order():
    assert partition_params([[4, 4, 4, 4]], 2) == [[[0, 2]], [[1, 3]]]


def test_every_parameter_owned_exactly_once_and_groups_respected():
    rng = random.Random(0)
    sizes = [[rng.randint(1, 1000) for _ in range(n)] for n in (7, 0, 13, 1)]
    for world in (1, 2, 3, 4, 8):
        part = partition_params(sizes, world)
        assert len(part) == world and all(len(per_rank) == len(sizes) for per_rank in part)
        for g, group in enumerate(sizes):
            got = sorted(i for per_rank in part for i in per_rank[g])
            assert got == list(range(len(group))), (world, g)
        assert len(owners(part)) == sum(len(s) for s in sizes)


@pytest.mark.parametrize("world", (2, 3, 4, 7))
def test_greedy_bound_total_over_n_plus_largest(world):
    rng = random.Random(world)
    for _ in range(50):
        sizes = [[rng.choice((1, 10, 100, 4096)) * rng.randint(1, 9)
                  for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 3))]
        flat = list(itertools.chain(*sizes))
        loads = rank_loads(partition_params(sizes, world), sizes)
        trainable = [load[0] for load in loads]
        assert sum(trainable) == sum(flat) and all(load[1] == 0 for load in loads)
        assert max(trainable) <= sum(flat) / world + max(flat)


def test_balance_is_over_the_whole_model_across_groups():
    # group 0 puts 10 on r0; group 1's big parameter must then go to r1
    assert partition_params([[10], [10, 1]], 2) == [[[0], [1]], [[], [0]]]


def test_adding_a_group_never_moves_earlier_parameters():
    sizes = [[9, 3, 5], [2, 2, 8, 1]]
    before = partition_params(sizes, 3)
    after = partition_params(sizes + [[4, 6]], 3)
    assert [per_rank[:2] for per_rank in after] == before
    loads = rank_loads(before, sizes)
    added = partition_params([[4, 6]], 3, loads)
    assert [per_rank[2] for per_rank in after] == [per_rank[0] for per_rank in added]


def test_more_ranks_than_parameters_leaves_ranks_empty():
    assert partition_params([[3, 1]], 4) == [[[0]], [[1]], [[]], [[]]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        partition_params([[1]], 0)
    with pytest.raises(ValueError, match="loads has 1 entries for world size 2"):
        partition_params([[1]], 2, [0])


def test_global_indices_number_consecutively_over_groups():
    assert global_indices([2, 0, 3]) == [[0, 1], [], [2, 3, 4]]


def test_chunk_by_bytes():
    assert chunk_by_bytes([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert chunk_by_bytes([], 8) == []
    with pytest.raises(ValueError, match="chunk cap must be positive"):
        chunk_by_bytes([1], 0)


def test_trainable_bytes_balanced_first_then_frozen_bytes():
    # (trainable, frozen): the frozen 100 weighs nothing against trainable bytes, so the
    # trainable 6, 5, 4, 3 are balanced as if it were not there (6+3 on r0, 5+4 on r1); the
    # frozen ones go last, each to the rank with the least (trainable, frozen) load: 100 to r0
    # (tie, lowest rank), then 7 to r1
    sizes = [[(0, 100), (3, 0), (5, 0), (0, 7), (6, 0), (4, 0)]]
    part = partition_params(sizes, 2)
    assert part == [[[0, 1, 4]], [[2, 3, 5]]]
    assert rank_loads(part, sizes) == [(9, 100), (9, 7)]
    # ties on trainable bytes: the frozen bytes spread over the ranks
    both = [[(0, 9), (0, 7), (0, 5), (0, 3), (0, 9), (0, 7), (0, 5), (0, 3)]]
    assert rank_loads(partition_params(both, 2), both) == [(0, 24), (0, 24)]


def test_all_trainable_one_dtype_is_the_numel_greedy_partition():
    # what torch's sorted greedy by numel() gives for [9, 7, 5, 3] * 2: r0 9 7 5 3, r1 the same
    sizes = [[9, 7, 5, 3, 9, 7, 5, 3]]
    assert partition_params(sizes, 2) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
