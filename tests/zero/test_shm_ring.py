"""The stage-2 shared-memory ring's plan ([Note: stage 2 shared-memory ring]): pure functions."""

import pytest
import torch

from shardwise.dp.buckets import Bucket, BucketState
from shardwise.zero.shm_ring import RegionRing, plan_regions, ring_capacity


def test_regions_pack_in_order_aligned_and_wrap_where_a_bucket_would_pass_the_end():
    assert plan_regions([5, 7, 3], 100, align=4) == [0, 8, 16]
    assert plan_regions([5, 7, 3], 16, align=4) == [0, 8, 0]  # 16 + 3 > 16: wraps
    assert plan_regions([10, 10, 10], 20) == [0, 10, 0]
    with pytest.raises(ValueError, match="does not fit a ring of 8"):
        plan_regions([4, 9], 8)


def test_capacity_is_every_bucket_its_own_region_or_a_multiple_of_the_largest():
    assert ring_capacity([5, 7, 3], 3, align=4) == 19  # 0..5 | 8..15 | 16..19
    assert ring_capacity([5, 7, 3], 2, align=4) == 14  # 2 x 7
    with pytest.raises(ValueError, match="largest bucket"):
        ring_capacity([5], 0.5)


def _buckets(numels):
    out = []
    for i, n in enumerate(numels):
        p = torch.nn.Parameter(torch.zeros(n))
        out.append(Bucket(i, [p], [f"p{i}"], [0], None, n, [False]))
    return out


def test_a_region_is_refused_while_an_overlapping_bucket_needs_it():
    buckets = _buckets([6, 6, 6])  # ring of 12: bucket 2 wraps onto bucket 0's bytes
    ring = RegionRing(buckets, 12)
    assert ring.overlaps == [[2], [], [0]]
    never = lambda j: False  # noqa: E731
    read = lambda seq: True  # noqa: E731
    # bucket 2 first (gradients out of order): bucket 0, launched before it, is still to fill
    assert not ring.may_fill(2, never, read)
    assert ring.may_fill(0, never, read) and ring.may_fill(1, never, read)
    buckets[0].state = BucketState.LAUNCHED
    ring.last_seq[0] = 7
    assert not ring.may_fill(2, never, lambda seq: seq < 7)  # not everyone has read bucket 0
    assert ring.may_fill(2, never, lambda seq: seq <= 7)
    buckets[0].state = BucketState.FILLING  # the next backward: bucket 2 holds the bytes now
    assert not ring.may_fill(0, lambda j: j == 2, read)
    assert ring.private_fills == 3
