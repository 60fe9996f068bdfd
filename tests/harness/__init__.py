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
tensor's scale (see compare.py). Ranks start once per world size and are reused by every
test; a failing or hung test kills its pool (the next test gets a fresh one) and raises with
each failing rank's traceback. How processes start, the reset before each test, patching and
the single-process reference: docs/testing.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# each name's module, imported on first use: a program or rank started by procs.py imports
# this package, and must not import torch with it unless it asks for a name that needs it
_HOMES = {
    "rank_slice": "batches", "token_batch": "batches",
    "assert_rel_close": "compare", "assert_state_close": "compare", "local_part": "compare",
    "max_rel_diff": "compare", "shard0_rows": "compare",
    "WORLD_SIZES": "pool", "RankContext": "pool", "RankFailure": "pool", "TestTimeout": "pool",
    "run_on_ranks": "pool", "shutdown_pools": "pool",
    "reference_train": "reference",
    "peer_reads_permitted": "procs",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tests.harness' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tests.harness.{_HOMES[name]}"), name)


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
    "peer_reads_permitted",
    "rank_slice",
    "token_batch",
    "reference_train",
]
