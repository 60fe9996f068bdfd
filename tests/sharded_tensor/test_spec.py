"""Sharding math and spec validation as pure values (no processes)."""

import pytest
import torch

from shardwise.sharded_tensor import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    Placement,
    ShardingError,
    ShardMetadata,
)
from shardwise.sharded_tensor.metadata import chunk_offsets, chunk_sizes, overlap, parse_placement
from shardwise.sharded_tensor.redistribute import plan_pieces


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 6, 7, 8, 13])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5])
def test_chunk_sizes_match_torch_chunk(n, chunks):
    expected = [c.shape[0] for c in torch.arange(n).chunk(chunks)] if n else []
    got = chunk_sizes(n, chunks)
    assert len(got) == chunks
    assert got[: len(expected)] == expected  # torch.chunk's pieces, in order
    assert all(s == 0 for s in got[len(expected):])  # then empty chunks
    offsets = chunk_offsets(n, chunks)
    assert [sum(got[:i]) for i in range(chunks)] == offsets


def test_uneven_examples():
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]
    assert chunk_sizes(6, 4) == [2, 2, 2, 0]
    assert chunk_sizes(7, 2) == [4, 3]


def test_parse_placement_forms():
    assert parse_placement("rank:0/cpu") == Placement(0, torch.device("cpu"))
    assert parse_placement("rank:1/cuda:1") == Placement(1, torch.device("cuda", 1))
    assert parse_placement("rank:3") == Placement(3)
    assert parse_placement(2) == Placement(2)
    for bad in ("0/cpu", "rank:x/cpu", "node:0/cpu", -1, 1.5, "rank:0/nodevice"):
        with pytest.raises(ShardingError, match="placement"):
            parse_placement(bad)


def test_chunk_spec_metadata_uneven():
    spec = ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"])
    metas = spec.build_metadata((3, 5), world_size=4)
    assert [m.shard_offsets for m in metas] == [(0, 0), (0, 2), (0, 4), (0, 5)]
    assert [m.shard_sizes for m in metas] == [(3, 2), (3, 2), (3, 1), (3, 0)]
    assert [m.rank for m in metas] == [0, 1, 2, 3]
    # negative dim
    assert ChunkShardingSpec(-1, [0, 1]).build_metadata((3, 5))[1].shard_sizes == (3, 2)


def test_chunk_spec_errors_name_the_problem():
    with pytest.raises(ShardingError, match=r"Global rank 2 does not exist in input process "
                       r"group.*\[0, 1\]; ranks \[2, 3\]"):
        ChunkShardingSpec(0, [0, 1, 2, 3]).build_metadata((8,), world_size=2)
    with pytest.raises(ShardingError, match=r"ranks \[1\] appear more than once"):
        ChunkShardingSpec(0, [0, 1, 1])
    with pytest.raises(ShardingError, match="dim=2.*2 dimensions"):
        ChunkShardingSpec(2, [0]).build_metadata((3, 4))
    with pytest.raises(ShardingError, match="placements is empty"):
        ChunkShardingSpec(0, [])


def _shard(off, size, rank):
    return ShardMetadata(off, size, f"rank:{rank}/cpu")


def test_enumerable_spec_valid_and_errors():
    good = EnumerableShardingSpec([_shard((0, 0), (2, 4), 0), _shard((2, 0), (3, 1), 1),
                                   _shard((2, 1), (3, 3), 0)])
    assert len(good.build_metadata((5, 4), world_size=2)) == 3
    overlapping = EnumerableShardingSpec([_shard((0, 0), (3, 4), 0), _shard((2, 0), (3, 4), 1)])
    both = r"\[0:3, 0:4\] on rank:0/cpu and \[2:5, 0:4\].*overlap"
    with pytest.raises(ShardingError, match=both):
        overlapping.build_metadata((5, 4), world_size=2)
    missing = EnumerableShardingSpec([_shard((0, 0), (2, 4), 0), _shard((3, 0), (2, 4), 1)])
    with pytest.raises(ShardingError, match="cover 16 of the 20 elements.*missing"):
        missing.build_metadata((5, 4), world_size=2)
    with pytest.raises(ShardingError, match="Global rank 3 does not exist in input process"):
        EnumerableShardingSpec([_shard((0,), (4,), 3)]).build_metadata((4,), world_size=2)
    with pytest.raises(ShardingError, match="outside the tensor"):
        EnumerableShardingSpec([_shard((0,), (5,), 0)]).build_metadata((4,), world_size=1)
    with pytest.raises(ShardingError, match="no placement"):
        EnumerableShardingSpec([ShardMetadata((0,), (4,))])


def test_overlap_and_plan():
    a, b = _shard((0, 0), (4, 2), 0), _shard((2, 1), (4, 4), 1)
    assert overlap(a, b) == ((2, 1), (2, 1))
    assert overlap(a, _shard((4, 0), (1, 1), 1)) is None
    rows = ChunkShardingSpec(0, [0, 1]).build_metadata((4, 6))
    cols = ChunkShardingSpec(1, [0, 1]).build_metadata((4, 6))
    pieces = plan_pieces(rows, cols)
    # every (row chunk, column chunk) pair meets in a 2x3 box; ordered by target, then source
    assert [(p.src, p.dst, p.offsets, p.sizes) for p in pieces] == [
        (0, 0, (0, 0), (2, 3)), (1, 0, (2, 0), (2, 3)),
        (0, 1, (0, 3), (2, 3)), (1, 1, (2, 3), (2, 3))]
    assert sum(p.numel for p in pieces) == 24


def test_shard_size_mismatch_is_named():
    from shardwise.sharded_tensor import Shard

    with pytest.raises(ShardingError, match=r"size \(3, 4\) but its metadata says \(2, 4\)"):
        Shard(torch.zeros(3, 4), _shard((0, 0), (2, 4), 0))


def test_placements_name_global_ranks_mapped_to_the_group():
    # the group made of global ranks [2, 3]: chunk i goes to the process the spec names
    spec = ChunkShardingSpec(0, ["rank:3/cpu", "rank:2/cpu"])
    metas = spec.group_metadata((5, 2), [2, 3])
    assert [m.rank for m in metas] == [1, 0]  # ranks within the group
    assert [m.shard_offsets for m in metas] == [(0, 0), (3, 0)]
    assert [m.placement.device for m in metas] == [torch.device("cpu")] * 2
    assert [p.rank for p in spec.placements] == [3, 2]  # the spec keeps the global ranks
    enum = EnumerableShardingSpec([_shard((0,), (1,), 5), _shard((1,), (3,), 1)])
    assert [m.rank for m in enum.group_metadata((4,), [1, 5])] == [1, 0]
    with pytest.raises(ShardingError, match=r"Global rank 0 does not exist in input process "
                       r"group.*global ranks are \[2, 3\]"):
        ChunkShardingSpec(0, [0, 1]).group_metadata((4,), [2, 3])
    with pytest.raises(ShardingError, match="Global rank 2 does not exist"):
        enum_bad = EnumerableShardingSpec([_shard((0,), (4,), 2)])
        enum_bad.group_metadata((4,), [1, 5])
    with pytest.raises(ShardingError, match="cover 3 of the 4"):
        EnumerableShardingSpec([_shard((0,), (3,), 1)]).group_metadata((4,), [1, 5])
