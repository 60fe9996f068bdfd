"""The multi-process test harness: run a test body on every rank of a gloo world on CPU.

Usage in a test module::

    from tests.harness import WORLD_SIZES, run_on_ranks

    def _body(ctx, scale):              # module level, so the workers can import it
        t = torch.ones(2) * (ctx.rank + 1) * scale
        dist.all_reduce(t, group=ctx.group)
        return t

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_sum(world_size):
        results = run_on_ranks(world_size, _body, 2.0)   # one return value per rank
        ...

Compare with ``assert_rel_close(actual, expected, rtol, what)``: tolerance relative to the
tensor's scale (see compare.py). Workers are spawned once per world size and reused by every
test; a failing or hung test kills its pool (the next test gets a fresh one) and raises with
each failing rank's traceback.
"""

from tests.harness.batches import rank_slice, token_batch
from tests.harness.compare import (
    assert_rel_close,
    assert_state_close,
    local_part,
    max_rel_diff,
    shard0_rows,
)
from tests.harness.pool import (
    WORLD_SIZES,
    RankContext,
    RankFailure,
    TestTimeout,
    run_on_ranks,
    shutdown_pools,
)

__all__ = [
    "WORLD_SIZES",
    "assert_rel_close",
    "assert_state_close",
    "local_part",
    "shard0_rows",
    "max_rel_diff",
    "RankContext",
    "RankFailure",
    "TestTimeout",
    "run_on_ranks",
    "shutdown_pools",
    "rank_slice",
    "token_batch",
]
