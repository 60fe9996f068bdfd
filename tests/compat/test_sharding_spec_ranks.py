"""Placements name global ranks, as in ``torch.distributed._shard``: the same program, with the
imports swapped, runs against torch's sharded tensors and ours on the subgroup of global ranks
{2, 3} of a world of 4 (what a tensor-parallel group of the second data-parallel replica is),
with specs that list its ranks in order (``["rank:2", "rank:3"]``) and reversed (chunk 0 on
process 3), and with ``ShardMetadata`` built from the global rank. ``torch.distributed.new_group``
sorts its ranks, so a group's rank order always follows the global order; the reversed spec is
what exercises a mapping that is not the identity. What torch 2.13 still runs is compared:
creation, ``init_from_local_shards``, ``shard_parameter`` of an embedding (the forward against the
plain embedding: torch's sharded embedding forward on this subgroup gives other numbers), and
torch's error for a placement outside the group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks

GROUP = [2, 3]
IDS = [[0, 5, 10], [3, 3, 7]]


def _api(impl: str):
    if impl == "torch":
        from torch.distributed._shard import shard_parameter, sharded_tensor
        from torch.distributed._shard.sharded_tensor import Shard
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec, ShardMetadata
        return (ChunkShardingSpec, ShardMetadata, Shard, sharded_tensor.full,
                sharded_tensor.init_from_local_shards, shard_parameter)
    import shardwise.sharded_tensor as st
    return (st.ChunkShardingSpec, st.ShardMetadata, st.Shard, st.full, st.init_from_local_shards,
            st.shard_parameter)


def _offsets(shard) -> list[int]:
    return [int(o) for o in shard.metadata.shard_offsets]


def _program(ctx, impl, order):
    Chunk, ShardMetadata, Shard, full, from_local, shard_parameter = _api(impl)
    group = dist.new_group(GROUP)  # every rank calls new_group; ranks 0 and 1 are not in it
    if ctx.rank not in GROUP:
        return None
    places = [f"rank:{r}/cpu" for r in (GROUP if order == "in_order" else GROUP[::-1])]
    spec = Chunk(dim=0, placements=places)
    out = {}
    # creation: which rows this process holds
    t = full(spec, (5, 3), 7.0, process_group=group)
    out["full"] = [(_offsets(s), s.tensor.clone()) for s in t.local_shards()]
    # init_from_local_shards with this process's global rank in the placement
    me = dist.get_rank()
    row = GROUP.index(me)
    local = torch.arange(6.0).view(2, 3) + 10 * me
    meta = ShardMetadata(shard_offsets=[2 * row, 0], shard_sizes=[2, 3], placement=f"rank:{me}/cpu")
    t2 = from_local([Shard(local, meta)], 4, 3, process_group=group)
    out["from_local"] = [(_offsets(s), s.tensor.clone()) for s in t2.local_shards()]
    # shard_parameter of an embedding (src_rank: a rank of the group), then its forward
    torch.manual_seed(0)
    emb = nn.Embedding(11, 4)
    shard_parameter(emb, "weight", Chunk(dim=0, placements=places), src_rank=0,
                    process_group=group)
    out["emb_local"] = [(_offsets(s), s.tensor.detach().clone())
                        for s in emb.weight.local_shards()]
    out["emb_out"] = emb(torch.tensor(IDS)).detach().clone()
    # a placement outside the group: torch's error
    try:
        full(Chunk(dim=0, placements=["rank:1/cpu", "rank:3/cpu"]), (4,), 1.0,
             process_group=group)
        out["outside"] = None
    except ValueError as err:
        out["outside"] = str(err)
    return out


@pytest.mark.parametrize("order", ["in_order", "reversed"])
def test_global_rank_placements_on_a_subgroup_like_torch(order):
    ours = run_on_ranks(4, _program, "shardwise", order)
    theirs = run_on_ranks(4, _program, "torch", order)
    assert ours[0] is None and ours[1] is None
    torch.manual_seed(0)
    weight = nn.Embedding(11, 4).weight.detach()
    for rank in GROUP:
        mine, torchs = ours[rank], theirs[rank]
        chunk = GROUP.index(rank) if order == "in_order" else GROUP[::-1].index(rank)
        for key in ("full", "from_local", "emb_local"):
            assert len(mine[key]) == len(torchs[key]) == 1, key
            (off, value), (t_off, t_value) = mine[key][0], torchs[key][0]
            assert off == t_off, (key, off, t_off)
            torch.testing.assert_close(value, t_value, rtol=0, atol=0)
        # the chunk this process holds follows its global rank's position in the spec
        assert mine["full"][0][0] == [3 * chunk, 0]
        torch.testing.assert_close(mine["emb_local"][0][1], weight[6 * chunk: 6 * chunk + 6])
        torch.testing.assert_close(mine["emb_out"], weight[torch.tensor(IDS)])
        # torch 2.13's sharded embedding forward on this subgroup does not give the plain
        # lookup (its shards are right, see emb_local): ours is compared with the plain module
        assert "Global rank 1 does not exist in input process group" in torchs["outside"]
        assert "Global rank 1 does not exist in input process group" in mine["outside"]
