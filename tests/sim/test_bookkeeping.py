"""The library's own bookkeeping per rank grows at most linearly with the world size.

Bookkeeping is what ``shardwise.sim.bookkeeping.bookkeeping_size`` counts (see
[Note: bookkeeping size]): the Python objects reachable from the wrapped model and its
optimizer after a dry run's step, each ``sys.getsizeof`` once, plus real tensors' bytes; model
state is fake there and not counted. Going from 1,024 to 8,192 ranks may multiply it by at most
16 (twice linear growth: the model's own objects are a constant part, so linear growth gives
at most 8). A quadratic structure fails that by far: an N x N table of 8-byte slots is already
8 MiB at 1,024 ranks, against about 0.3 MB for the whole bookkeeping of the model below, and
grows 64-fold; ``test_a_quadratic_table_fails_the_bound`` shows it on a smaller world.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.sim.bookkeeping import bookkeeping_size
from shardwise.sim.fake_group import fake_tensors
from shardwise.sim.models import demo_gpt
from shardwise.sim.step import DryRun, simulate_step
from tests.sim.configs import TINY


def _bookkeeping(strategy: str, world: int, extra=None):
    def measure(wrapped):
        roots = (wrapped.model, wrapped.optimizer, *([extra(world)] if extra else []))
        return {"size": bookkeeping_size(*roots)}

    run = DryRun(strategy, world, replicas=8 if strategy == "hsdp" else 1)
    return simulate_step(lambda: demo_gpt(TINY), run, after=measure).extra["size"]


def _within_twice_linear(small, large, factor: int) -> bool:
    return (large.bytes <= 2 * factor * small.bytes
            and large.objects <= 2 * factor * small.objects)


@pytest.mark.parametrize("strategy", ["fsdp", *(pytest.param(s, marks=pytest.mark.slow)
                                                 for s in ("ddp", "zero1", "zero2", "hsdp"))])
def test_bookkeeping_at_8192_ranks_is_at_most_16_times_that_at_1024(strategy):
    small, large = _bookkeeping(strategy, 1024), _bookkeeping(strategy, 8192)
    assert _within_twice_linear(small, large, 8), (strategy, small, large)


@pytest.mark.slow
def test_a_quadratic_table_fails_the_bound():
    """The same measurement with an N x N table of 8-byte entries beside the wrapped model,
    at 128 and 1,024 ranks (the table of 8,192 ranks would take half a GiB)."""
    def table(world):
        return [bytes(8 * world) for _ in range(world)]

    small, large = _bookkeeping("fsdp", 128, table), _bookkeeping("fsdp", 1024, table)
    assert not _within_twice_linear(small, large, 8), (small, large)


def test_each_object_is_counted_once_and_globals_are_not_followed():
    shared = list(range(1000))
    assert bookkeeping_size([shared]).objects == 1 + 1 + 1000  # the outer list, shared, ints
    assert bookkeeping_size([shared, shared]).objects == 1 + 1 + 1000

    def closure():
        return shared  # a captured list is held

    def global_reader():
        return GLOBAL_TABLE  # a module global is not the function's own

    assert bookkeeping_size(closure).bytes >= bookkeeping_size(shared).bytes
    assert bookkeeping_size(global_reader).bytes < bookkeeping_size(GLOBAL_TABLE).bytes


GLOBAL_TABLE = list(range(10_000))


def test_real_tensors_count_their_bytes_and_fake_ones_do_not():
    real = torch.zeros(1000, dtype=torch.float64)
    with fake_tensors():
        fake = torch.zeros(1000, dtype=torch.float64)
    assert bookkeeping_size(real).bytes >= 8000 > 1000 > bookkeeping_size(fake).bytes
    assert bookkeeping_size(torch.zeros(10**6, device="meta")).bytes < 1000
