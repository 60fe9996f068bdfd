"""Rank order of a device mesh (pure functions): row-major like torch, groups by lowest rank."""

import pytest
import torch

from shardwise.distributed.topology import (
    InvalidMeshError,
    check_dim_names,
    check_mesh_shape,
    coordinate,
    dim_groups,
    group_of,
    hybrid_mesh_shape,
    local_world_size_from_env,
    mesh_ranks,
    node_of,
)

SHAPES = [(4,), (2, 2), (1, 4), (4, 1), (2, 4), (2, 2, 2), (3, 1, 2), (1,)]


def _torch_groups(shape, dim):
    """The groups along ``dim`` read off torch.arange(world).reshape(shape), torch's layout."""
    mesh = torch.arange(torch.Size(shape).numel()).reshape(shape)
    rows = mesh.movedim(dim, -1).reshape(-1, shape[dim])
    return sorted(tuple(r.tolist()) for r in rows)


@pytest.mark.parametrize("shape", SHAPES)
def test_groups_along_each_dim_match_the_row_major_reshape(shape):
    for dim in range(len(shape)):
        groups = dim_groups(shape, dim)
        assert groups == _torch_groups(shape, dim)  # same groups, listed by lowest rank
        assert sorted(r for g in groups for r in g) == list(range(torch.Size(shape).numel()))
        for g in groups:  # group rank i is the rank at coordinate i along dim
            assert [coordinate(r, shape)[dim] for r in g] == list(range(shape[dim]))


def test_the_2x4_example_of_the_note():
    assert dim_groups((2, 4), 0) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert dim_groups((2, 4), 1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert dim_groups((2, 4), -1) == dim_groups((2, 4), 1)
    assert group_of(6, (2, 4), 0) == (2, 6) and group_of(6, (2, 4), 1) == (4, 5, 6, 7)
    assert mesh_ranks((2, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh_ranks((2, 2, 2)) == torch.arange(8).reshape(2, 2, 2).tolist()
    assert coordinate(6, (2, 4)) == (1, 2) and coordinate(5, (2, 2, 2)) == (1, 0, 1)
    with pytest.raises(IndexError):
        dim_groups((2, 4), 2)
    with pytest.raises(ValueError, match="outside"):
        coordinate(8, (2, 4))


def test_a_shape_whose_product_is_not_the_world_size_shows_every_factor():
    assert check_mesh_shape([2, 2], 4) == (2, 2)
    with pytest.raises(InvalidMeshError, match=r"\(2, 3\) has 2 x 3 = 6 ranks.*world size is 4"):
        check_mesh_shape((2, 3), 4)
    with pytest.raises(RuntimeError):  # also what torch raises
        check_mesh_shape((8,), 4)
    for bad in [(), (0, 4), (2.0, 2), (-1, -4), (True, 4)]:
        with pytest.raises(InvalidMeshError):
            check_mesh_shape(bad, 4)


def test_dim_names_must_be_distinct_and_one_per_dimension():
    assert check_dim_names(None, 2) is None
    assert check_dim_names(["dp", "tp"], 2) == ("dp", "tp")
    with pytest.raises(InvalidMeshError, match=r"repeats \['dp'\]"):
        check_dim_names(("dp", "dp"), 2)
    with pytest.raises(InvalidMeshError, match="1 names for a mesh of 2"):
        check_dim_names(("dp",), 2)
    with pytest.raises(InvalidMeshError, match="string"):
        check_dim_names("dp", 1)
    with pytest.raises(InvalidMeshError, match="non-empty"):
        check_dim_names(("dp", ""), 2)


def test_hybrid_shape_replicates_across_nodes_and_shards_within_one(monkeypatch):
    assert hybrid_mesh_shape(8, 4) == (2, 4)
    assert hybrid_mesh_shape(4, 4) == (1, 4)
    assert hybrid_mesh_shape(4, 1) == (4, 1)
    # the shard (last) dimension's groups are exactly the nodes' ranks
    shape = hybrid_mesh_shape(8, 4)
    assert [{node_of(r, 4) for r in g} for g in dim_groups(shape, 1)] == [{0}, {1}]
    assert all(len({node_of(r, 4) for r in g}) == 2 for g in dim_groups(shape, 0))
    with pytest.raises(InvalidMeshError, match="6 is not a multiple of the ranks per node"):
        hybrid_mesh_shape(6, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size_from_env(8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size_from_env(8) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE"):
        local_world_size_from_env(8)
    assert [node_of(r, 2) for r in range(4)] == [0, 0, 1, 1]
