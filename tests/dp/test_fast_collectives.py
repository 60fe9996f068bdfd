"""The fast all-gather / reduce-scatter against the plain c10d collectives and a local reference."""

import pytest
import torch
import torch.distributed as dist

from shardwise.dp.fast_collectives import (
    Pending,
    all_gather_flat,
    reduce_scatter_flat,
)
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

SHARD = 7  # odd on purpose: nothing lines up with a power of two


def _data(rank: int, world: int, dtype: torch.dtype, integral: bool) -> torch.Tensor:
    """Rank ``rank``'s full buffer (world * SHARD elements), reproducible on every rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    if integral:  # sums of small integers are exact in any order
        return torch.randint(-50, 50, (world * SHARD,), generator=gen).to(dtype)
    return torch.randn(world * SHARD, generator=gen, dtype=torch.float64).to(dtype)


def _check_group(members: list[int], group, me: int, dtype, integral: bool) -> None:
    world = len(members)
    fulls = [_data(r, world, dtype, integral) for r in range(world)]
    shards = [f[:SHARD] * (r + 1) for r, f in enumerate(fulls)]
    expected_gather = torch.cat(shards)
    expected_sum = torch.stack([f.double() for f in fulls]).sum(0)[me * SHARD : (me + 1) * SHARD]

    for impl in ("fast", "plain"):
        out = torch.full((world * SHARD,), float("nan"), dtype=dtype)
        all_gather_flat(out, shards[me], group, impl=impl)
        assert torch.equal(out, expected_gather), f"all_gather_flat impl={impl}"

    results = {}
    for impl in ("fast", "plain"):
        for average in (False, True):
            full = fulls[me].clone()
            shard_out = torch.empty(SHARD, dtype=dtype)
            # a caller's workspace (larger than needed) on one of the fast calls
            space = torch.zeros((world - 1) * SHARD + 3, dtype=dtype) if average else None
            pending = reduce_scatter_flat(shard_out, full, group, average=average,
                                          async_op=True, impl=impl, workspace=space)
            assert isinstance(pending, Pending)
            pending.wait()
            pending.wait()  # idempotent: must not sum or divide twice
            assert torch.equal(full, fulls[me]), "reduce_scatter_flat modified its input"
            expected = expected_sum / world if average else expected_sum
            if integral and not average:
                assert torch.equal(shard_out.double(), expected), f"impl={impl}"
            else:
                assert_rel_close(shard_out, expected.to(dtype), 1e-6 if dtype != torch.bfloat16
                                 else 1e-2, f"reduce_scatter impl={impl} average={average}")
            results[impl, average] = shard_out
    if integral:
        assert torch.equal(results["fast", False], results["plain", False])


def _equal_to_plain_and_reference(ctx):
    everyone = list(range(ctx.world_size))
    for dtype, integral in ((torch.float32, True), (torch.float32, False),
                            (torch.float64, False)):
        _check_group(everyone, ctx.group, ctx.rank, dtype, integral)
    if ctx.world_size == 4:  # a subgroup: group ranks differ from global ranks
        members = [1, 2, 3]
        sub = dist.new_group(members)
        if ctx.rank in members:
            _check_group(members, sub, members.index(ctx.rank), torch.float32, True)
        dist.destroy_process_group(sub)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fast_collectives_equal_plain_ones_and_the_reference(world_size):
    run_on_ranks(world_size, _equal_to_plain_and_reference)


def _many_in_flight(ctx):
    """Several collectives issued before any is waited for, waited in reverse order."""
    world = ctx.world_size
    pend, outs = [], []
    for k in range(5):
        out = torch.empty(world * SHARD)
        shard = torch.full((SHARD,), float(100 * k + ctx.rank))
        pend.append(all_gather_flat(out, shard, ctx.group, async_op=True))
        outs.append(out)
    reduced = []
    for k in range(5):  # reduce-scatters in flight together too (point-to-point on gloo)
        shard = torch.empty(SHARD)
        full = torch.arange(world * SHARD, dtype=torch.float32) * (ctx.rank + 1) + k
        pend.append(reduce_scatter_flat(shard, full, ctx.group, average=False, async_op=True))
        reduced.append(shard)
    for p in reversed(pend):
        p.wait()
    for k, out in enumerate(outs):
        expected = torch.cat([torch.full((SHARD,), float(100 * k + r)) for r in range(world)])
        assert torch.equal(out, expected), f"collective {k}"
    mine = torch.arange(ctx.rank * SHARD, (ctx.rank + 1) * SHARD, dtype=torch.float32)
    for k, shard in enumerate(reduced):
        expected = mine * (world * (world + 1) // 2) + k * world
        assert torch.equal(shard, expected), f"reduce-scatter {k}"


@pytest.mark.parametrize("world_size", (2, 4))
def test_collectives_in_flight_together_keep_their_order(world_size):
    run_on_ranks(world_size, _many_in_flight)


def _bad_sizes(ctx):
    with pytest.raises(ValueError, match=r"world_size \(2\) x shard \(3\) = 6"):
        all_gather_flat(torch.empty(5), torch.empty(3), ctx.group)
    with pytest.raises(ValueError, match="must be 1D"):
        reduce_scatter_flat(torch.empty(3), torch.empty(2, 3), ctx.group)
    with pytest.raises(ValueError, match="impl must be"):
        all_gather_flat(torch.empty(6), torch.empty(3), ctx.group, impl="quick")
    full = torch.zeros(6)
    with pytest.raises(ValueError, match="shard_out must not overlap full"):
        reduce_scatter_flat(full[2:5], full, ctx.group)  # it would receive into what it sends


def test_bad_buffers_are_rejected_before_any_communication():
    run_on_ranks(2, _bad_sizes)
