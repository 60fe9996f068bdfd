"""The harness itself: results per rank, failures reported with tracebacks, hangs cut off."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import WORLD_SIZES, RankFailure, TestTimeout, run_on_ranks


def _all_reduce_rank(ctx, scale):
    t = torch.full((3,), float(ctx.rank + 1)) * scale
    dist.all_reduce(t, group=ctx.group)
    return ctx.rank, ctx.world_size, t


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_returns_its_result(world_size):
    results = run_on_ranks(world_size, _all_reduce_rank, 2.0)
    expected = 2.0 * world_size * (world_size + 1) / 2
    assert [r[0] for r in results] == list(range(world_size))
    for _, ws, t in results:
        assert ws == world_size
        torch.testing.assert_close(t, torch.full((3,), expected))


def _fail_on_last_rank(ctx):
    if ctx.rank == ctx.world_size - 1:
        assert ctx.rank == -1, "deliberate failure on the last rank"
    dist.barrier(group=ctx.group)  # the others wait on the failed rank: must not hang the test


def test_failing_rank_reports_traceback_and_pool_recovers():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _fail_on_last_rank, timeout=30)
    assert "deliberate failure on the last rank" in str(info.value)
    assert "rank 1" in str(info.value)
    # the pool was replaced: the next test body runs normally
    assert [r[0] for r in run_on_ranks(2, _all_reduce_rank, 1.0)] == [0, 1]


def _sleep_on_rank0(ctx, seconds):
    if ctx.rank == 0:
        time.sleep(seconds)
    return ctx.rank


def test_hung_rank_times_out():
    with pytest.raises(TestTimeout, match=r"ranks \[0\]"):
        run_on_ranks(2, _sleep_on_rank0, 60, timeout=2)
    assert run_on_ranks(2, _sleep_on_rank0, 0) == [0, 1]
