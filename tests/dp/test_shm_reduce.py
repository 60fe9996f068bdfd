"""Same-host shared-memory reduction against gloo's all-reduce and the one-process reference."""

import os
import stat
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.ddp import DistributedDataParallel
from shardwise.distributed.host import segment as shm_segment
from shardwise.distributed.host.segment import SHM_DIR
from shardwise.dp import shm_reduce
from shardwise.dp.shm_reduce import DISABLE_VAR, ShmReducer, usable
from shardwise.launch.errors import is_consequence
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

LAYOUTS = [(7, torch.float32), (1000, torch.float64), (3, torch.float32), (64, torch.bfloat16)]


def _ours_left() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith("shardwise-")]


def _data(rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + numel)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _equals_all_reduce(ctx):
    if ctx.world_size == 1:
        assert not usable(ctx.group, torch.device("cpu"), LAYOUTS), "one rank: nothing to reduce"
        return
    assert usable(ctx.group, torch.device("cpu"), LAYOUTS)
    modes = []
    real_unlink = shm_segment._unlink

    def recording_unlink(path):
        modes.append(stat.S_IMODE(os.stat(path).st_mode))
        real_unlink(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shm_segment, "_unlink", recording_unlink)
        reducer = ShmReducer(LAYOUTS, ctx.group)
    if ctx.rank == 0:
        assert modes == [0o600], f"segment mode {modes}"
    dist.barrier(group=ctx.group)  # rank 0 unlinks right after the constructor's barrier
    assert _ours_left() == [], "the segment must be unlinked once every rank mapped it"
    try:
        for step in range(3):  # slots are reused: a later step must not see an earlier one
            works = []
            for i, (numel, dtype) in enumerate(LAYOUTS):
                reducer.buffer(i).copy_(_data(ctx.rank, numel, dtype, step))
                works.append(reducer.launch(i))
            for i, work in reversed(list(enumerate(works))):
                work.wait()
                numel, dtype = LAYOUTS[i]
                plain = _data(ctx.rank, numel, dtype, step)
                dist.all_reduce(plain, group=ctx.group)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
                assert_rel_close(reducer.buffer(i), plain, tol, f"bucket {i} step {step}")
                exact = sum(_data(k, numel, torch.float64, step).to(dtype).double()
                            for k in range(ctx.world_size))
                assert_rel_close(reducer.buffer(i).double(), exact, tol, f"bucket {i} exact")
        gathered = [torch.empty(1000, dtype=torch.float64) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, reducer.buffer(1).clone(), group=ctx.group)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks differ in bits"
    finally:
        reducer.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shm_reduction_equals_gloo_all_reduce(world_size):
    run_on_ranks(world_size, _equals_all_reduce)


def _scatter_sums_each_part(ctx):
    numel = 50
    # uneven parts, in no order, rank 1's empty, a gap that no one reads
    bounds = [(10, 30), (0, 0), (30, 47), (0, 10)][: ctx.world_size]
    reducer = ShmReducer([(numel, torch.float64)] * 2, ctx.group)
    try:
        for step in range(4):  # two slots used alternately: each reused twice
            slot = step % 2
            reducer.wait_slot(slot)  # every rank has read what the slot held
            reducer.buffer(slot).copy_(_data(ctx.rank, numel, torch.float64, step))
            start, end = bounds[ctx.rank]
            out = torch.empty(end - start, dtype=torch.float64) if end > start else None
            reducer.launch_scatter(slot, bounds[ctx.rank], out).wait()
            expected = _data(0, numel, torch.float64, step)
            for k in range(1, ctx.world_size):  # the same order: the same bits
                expected = expected + _data(k, numel, torch.float64, step)
            if out is not None:
                assert torch.equal(out, expected[start:end]), f"step {step}"
            assert torch.equal(reducer.buffer(slot), _data(ctx.rank, numel, torch.float64,
                                                           step)), "the slot is left as posted"
        # an all-reduce after reduce-scatters on the same reducer still lines up
        reducer.wait_slot(0)
        reducer.buffer(0).fill_(ctx.rank + 1)
        reducer.launch(0).wait()
        assert torch.equal(reducer.buffer(0), torch.full((numel,), float(
            sum(range(1, ctx.world_size + 1))), dtype=torch.float64))
    finally:
        reducer.close()


@pytest.mark.parametrize("world_size", (2, 4))
def test_shm_reduce_scatter_sums_each_ranks_part(world_size):
    run_on_ranks(world_size, _scatter_sums_each_part)


def _slot_busy_until_every_rank_read(ctx):
    reducer = ShmReducer([(8, torch.float32)], ctx.group)
    try:
        assert reducer.slot_free(0), "a slot never posted is free"
        reducer.buffer(0).fill_(ctx.rank + 1)
        if ctx.rank == 0:  # owns nothing: its wait returns without anyone having read the slot
            reducer.launch_scatter(0, (0, 0), None).wait()
            busy = not reducer.slot_free(0)
            dist.barrier(group=ctx.group)  # now rank 1 posts and sums its part
            dist.barrier(group=ctx.group)
            reducer.wait_slot(0)
            return busy, reducer.slot_free(0), None
        dist.barrier(group=ctx.group)
        out = torch.empty(8)
        reducer.launch_scatter(0, (0, 8), out).wait()
        dist.barrier(group=ctx.group)
        return None, reducer.slot_free(0), out
    finally:
        reducer.close()


def test_shm_reduce_scatter_slot_busy_until_every_rank_has_read_it():
    # wait() of a reduce-scatter returns once this rank's part is summed; the slot may be
    # refilled only when every rank has read it (slot_free / wait_slot)
    (busy, free0, _), (_, free1, out) = run_on_ranks(2, _slot_busy_until_every_rank_read)
    assert busy, "rank 0's slot was free before rank 1 had read it"
    assert free0 and free1
    assert torch.equal(out, torch.full((8,), 3.0))


def _peer_never_posts(ctx):
    reducer = ShmReducer([(16, torch.float32)], ctx.group, timeout=timedelta(seconds=1.5))
    try:
        if ctx.rank == 0:
            reducer.buffer(0).fill_(1.0)
            with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] .* not posted bucket 0"):
                reducer.launch(0).wait()
    finally:
        reducer.close()
    dist.barrier(group=ctx.group)


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    run_on_ranks(2, _peer_never_posts)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 40)
        self.c = nn.Linear(40, 5)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _ddp_matches_reference(ctx, disabled: bool):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DISABLE_VAR, "1" if disabled else "0")
        torch.manual_seed(0)
        model = _Net()
        ref = _Net()
        ref.load_state_dict(model.state_dict())
        ddp = DistributedDataParallel(model, process_group=ctx.group, bucket_cap_mb=0.004)
    expect_shm = ctx.world_size > 1 and not disabled
    assert (ddp._shm is not None) == expect_shm
    assert len(ddp.reducer.buckets) > 2
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        xs = torch.randn(ctx.world_size, 3, 12, generator=gen)
        ddp(xs[ctx.rank]).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        for k in range(ctx.world_size):
            ref(xs[k]).square().mean().div(ctx.world_size).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_rel_close(p.detach(), q.detach(), 1e-5, f"{name} after step {step}")


@pytest.mark.parametrize("disabled", [False, True], ids=["shm", "gloo"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_through_shared_memory_matches_the_reference(world_size, disabled):
    run_on_ranks(world_size, _ddp_matches_reference, disabled)


def _one_rank_lacks_room(ctx):
    """A rank whose /dev/shm is too small makes every rank take the gloo path (one collective
    decision); training still matches (checked above for the gloo path)."""
    with pytest.MonkeyPatch.context() as patch:
        if ctx.rank == 1:
            patch.setattr(shm_reduce, "room_for", lambda nbytes: False)
        torch.manual_seed(0)
        ddp = DistributedDataParallel(_Net(), process_group=ctx.group)
    assert ddp._shm is None


def _rank0_cannot_reserve(ctx):
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    if ctx.rank == 0:
        os.posix_fallocate = full
    try:
        with pytest.raises(RuntimeError, match=r"could not reserve \d+ bytes in /dev/shm"):
            ShmReducer(LAYOUTS, ctx.group)
    finally:
        os.posix_fallocate = real
    assert _ours_left() == []


@pytest.mark.parametrize("world_size", (2, 4))
def test_too_little_shared_memory_anywhere_means_the_gloo_path_everywhere(world_size):
    run_on_ranks(world_size, _one_rank_lacks_room)


def test_a_segment_that_cannot_be_reserved_is_a_named_error_on_every_rank():
    run_on_ranks(2, _rank0_cannot_reserve)


def test_a_peer_that_died_is_reported_as_a_consequence_so_the_launcher_blames_the_dead_rank():
    # a waiting rank's liveness check fires before gloo notices the closed connection (seen
    # under load): its error must read as a consequence, or the launcher blames the survivor
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)  # reaped: the pid names no process now
    reducer = object.__new__(ShmReducer)
    reducer.world = 2
    reducer._words = torch.tensor([[1, 1, 1, os.getpid()], [0, 0, 0, child]], dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of the group exited") as err:
        reducer._check_alive(reducer._words[:, 0], 1, 7)
    assert is_consequence(err.value)
