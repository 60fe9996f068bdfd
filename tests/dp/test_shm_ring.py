"""The shared-memory ring's all-gather and reduce-scatter against exact references, with
collectives larger than the ring (slots reused within one collective and across them)."""

import os

import pytest
import torch
import torch.distributed as dist

from shardwise.dp import shm_reduce
from shardwise.dp.shm_ring import ShmRing, ring_usable, slot_size
from tests.harness import run_on_ranks

SLOT = 256  # bytes: tiny slots, so every collective below takes many pieces


def _data(rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + numel)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _gathers_and_scatters(ctx):
    assert ring_usable(ctx.group, torch.device("cpu"), SLOT)
    ring = ShmRing(ctx.group, slot_bytes=SLOT, slots=3)
    world = ctx.world_size
    try:
        for step in range(2):
            works, checks = [], []
            for numel, dtype in [(1000, torch.float32), (5, torch.float64), (333, torch.bfloat16)]:
                got = torch.full((world, numel), float("nan"), dtype=dtype)

                def deliver(k, start, piece, got=got):
                    got[k, start : start + piece.numel()].copy_(piece)

                works.append(ring.all_gather(_data(ctx.rank, numel, dtype, step), deliver))
                want = torch.stack([_data(k, numel, dtype, step) for k in range(world)])
                checks.append((got, want))
            sizes = [70 + 13 * k for k in range(world)]  # parts of different sizes
            parts = [_data(ctx.rank, n, torch.float64, step + 7 * k) for k, n in
                     enumerate(sizes)]
            out = torch.empty(sizes[ctx.rank], dtype=torch.float64)
            works.append(ring.reduce_scatter(out, parts, average=True))
            exact = sum(_data(r, sizes[ctx.rank], torch.float64, step + 7 * ctx.rank)
                        for r in range(world)) / world
            for work in works:
                work.wait()
            for got, want in checks:
                assert torch.equal(got, want), "all-gather differs from every rank's input"
            torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)
    finally:
        ring.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_collectives_equal_their_exact_results(world_size):
    run_on_ranks(world_size, _gathers_and_scatters)


def _mismatch_is_named(ctx):
    ring = ShmRing(ctx.group, slot_bytes=SLOT, slots=2)
    try:
        numel = 10 if ctx.rank == 0 else 12
        work = ring.all_gather(torch.zeros(numel), lambda k, start, piece: None)
        with pytest.raises(RuntimeError, match="posted another collective"):
            work.wait()
    finally:
        dist.barrier(group=ctx.group)
        ring.close()


def test_ranks_issuing_different_collectives_get_an_error_not_mixed_data():
    run_on_ranks(2, _mismatch_is_named)


def _leaves_nothing(ctx):
    ring = ShmRing(ctx.group, slot_bytes=SLOT)
    dist.barrier(group=ctx.group)
    left = [n for n in os.listdir(shm_reduce.SHM_DIR) if n.startswith("shardwise-dp-")]
    ring.close()
    assert left == [], "the segment must be unlinked once every rank mapped it"


def test_the_segment_is_unlinked_once_mapped():
    run_on_ranks(2, _leaves_nothing)


def test_slot_size_follows_the_largest_collective_within_bounds():
    assert slot_size(1) == 64 << 10
    assert slot_size((64 << 10) + 1) == 128 << 10
    assert slot_size(1 << 40) == 2 << 20
