"""The flat-parameter layout math, checked against a brute-force element-by-element layout."""

import pytest

from shardwise.fsdp.padding import (
    flat_offsets,
    local_slices,
    padded_numel,
    padding_of,
    shard_bounds,
    shard_numel,
)


def _owner_by_element(numels, world):
    """(param index, element index) owned by each rank, computed one element at a time."""
    n = -(-sum(numels) // world)
    owned = {r: [] for r in range(world)}
    flat = [(i, j) for i, k in enumerate(numels) for j in range(k)]
    for pos, item in enumerate(flat):
        owned[pos // n].append(item)
    return owned


@pytest.mark.parametrize("numels", [[5], [3, 4, 1], [1, 1, 1, 1, 1], [10, 0, 7], [2, 30, 3]])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_local_slices_cover_every_element_once(numels, world):
    owned = _owner_by_element(numels, world)
    for rank in range(world):
        got = []
        for i, s in enumerate(local_slices(numels, rank, world)):
            got += [(i, s.param_offset + k) for k in range(s.length)]
        assert got == owned[rank]
        start, end = shard_bounds(rank, sum(numels), world)
        lengths = sum(s.length for s in local_slices(numels, rank, world))
        assert lengths + padding_of(rank, sum(numels), world) == end - start


def test_shard_offsets_are_positions_in_the_shard():
    # numels 3, 4, 1 over 2 ranks: padded 8, shards [0, 4) and [4, 8)
    s0, s1 = local_slices([3, 4, 1], 0, 2), local_slices([3, 4, 1], 1, 2)
    assert [(s.shard_offset, s.param_offset, s.length) for s in s0] == [
        (0, 0, 3), (3, 0, 1), (0, 0, 0)]
    assert [(s.shard_offset, s.param_offset, s.length) for s in s1] == [
        (0, 0, 0), (0, 1, 3), (3, 0, 1)]


def test_padding_and_bounds():
    assert padded_numel(10, 4) == 12 and shard_numel(10, 4) == 3
    assert padded_numel(8, 4) == 8 and padded_numel(0, 2) == 2
    assert shard_bounds(3, 10, 4) == (9, 12)
    assert padding_of(3, 10, 4) == 2 and padding_of(0, 10, 4) == 0
    assert flat_offsets([3, 4, 1]) == [0, 3, 7]
    with pytest.raises(ValueError, match="rank 4 is outside"):
        shard_bounds(4, 10, 4)
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(3, 0)
