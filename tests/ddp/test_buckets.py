"""Bucket planning is pure: walk parameters in reverse, cap by bytes, never mix dtypes."""

import pytest

from shardwise.dp.buckets import plan_buckets


def test_reverse_order_and_cap():
    assert plan_buckets([4, 4, 4, 4], ["f"] * 4, cap_bytes=8) == [[3, 2], [1, 0]]


def test_small_first_bucket_then_full_cap():
    assert plan_buckets([4, 4, 4, 4, 4], ["f"] * 5, cap_bytes=12, first_cap_bytes=4) == [
        [4], [3, 2, 1], [0]
    ]


def test_oversized_parameter_gets_its_own_bucket():
    assert plan_buckets([2, 100, 2], ["f"] * 3, cap_bytes=8) == [[2], [1], [0]]


def test_dtypes_never_share_a_bucket():
    buckets = plan_buckets([4, 4, 4, 4], ["a", "b", "a", "b"], cap_bytes=100)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]


def test_every_parameter_lands_in_exactly_one_bucket():
    sizes = [3, 9, 1, 7, 7, 2, 30, 5]
    buckets = plan_buckets(sizes, ["f"] * len(sizes), cap_bytes=10)
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 or len(b) == 1 for b in buckets)


def test_cap_must_be_positive():
    with pytest.raises(ValueError, match="bucket cap must be positive"):
        plan_buckets([4], ["f"], cap_bytes=0)


def test_tail_parameters_get_small_buckets():
    # registration order 0..5; the first 12 bytes (parameters 0-2) come last in backward
    sizes = [4, 4, 4, 4, 4, 4]
    assert plan_buckets(sizes, ["f"] * 6, cap_bytes=100, tail_bytes=12, tail_cap_bytes=4) == [
        [5, 4, 3], [2], [1], [0]
    ]
    # the first bucket's small cap still applies; a bucket never spans the tail's border
    assert plan_buckets(sizes, ["f"] * 6, cap_bytes=100, first_cap_bytes=4, tail_bytes=8,
                        tail_cap_bytes=8) == [[5], [4, 3, 2], [1, 0]]


def test_default_sizes_follow_the_cap():
    from shardwise.dp.buckets import MIB, BucketSizes

    assert BucketSizes.default() == BucketSizes(25 * MIB, MIB, 25 * MIB, 2 * MIB)
    small = BucketSizes.default(0.5)
    assert small.cap == small.first_cap == small.tail_cap == MIB // 2


def _hook_is_registered_on(ctx):
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from shardwise.ddp import DistributedDataParallel

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)])  # 3 MiB in all

    ddp = DistributedDataParallel(model(), process_group=ctx.group, bucket_cap_mb=1)
    before = [b.numel * 4 for b in ddp.reducer.buckets]
    ddp.register_comm_hook(ctx.group, default_hooks.allreduce_hook)
    after = [b.numel * 4 for b in ddp.reducer.buckets]
    assert ddp._shm is None, "a hook's collectives are its own: no shared-memory buckets"
    ddp(torch.randn(2, 256)).sum().backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        ddp.reducer.replan(ddp._bucket_sizes)
    theirs = torch.nn.parallel.DistributedDataParallel(model(), process_group=ctx.group,
                                                       bucket_cap_mb=1)
    theirs.register_comm_hook(ctx.group, default_hooks.allreduce_hook)
    for _ in range(2):  # torch rebuilds its buckets after the first step
        theirs(torch.randn(2, 256)).sum().backward()
    rebuilt = [b.buffer().numel() * 4 for b in theirs.reducer._get_zeros_like_grad_buckets()]
    return before, after, rebuilt


def test_a_comm_hook_gets_the_buckets_torch_uses_after_its_first_step():
    from tests.harness import run_on_ranks

    before, after, torch_sizes = run_on_ranks(2, _hook_is_registered_on)[0]
    assert before != after, before  # the default plan closes buckets before the cap
    assert after == torch_sizes, (after, torch_sizes)


def test_close_at_cap_passes_the_cap_by_one_parameter_as_torch_does():
    # torch closes a bucket once it holds at least the cap: 4+4 reaches 8, 4+4+4 passes 10
    assert plan_buckets([4, 4, 4, 4], ["f"] * 4, cap_bytes=8, close_at_cap=True) == [
        [3, 2], [1, 0]]
    assert plan_buckets([4, 4, 4, 4, 4], ["f"] * 5, cap_bytes=10, close_at_cap=True) == [
        [4, 3, 2], [1, 0]]
    from shardwise.dp.buckets import BucketSizes

    hooks = BucketSizes.default().for_hooks()
    assert (hooks.first_cap, hooks.tail_bytes, hooks.close_at_cap) == (None, 0, True)
    assert hooks.cap == BucketSizes.default().cap
