"""ShardedTensor against dense single-process references: creation, gather, reshard, element-wise
ops, reductions, and clear errors. World sizes 1, 2, 4; SIZE is uneven over 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

import shardwise.sharded_tensor as st_api
from shardwise.distributed import CommCounter
from shardwise.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardingError,
    ShardMetadata,
    UnsupportedShardedOp,
)
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks
from tests.sharded_tensor.specs import ALL, SIZE, rows

RTOL = 1e-6


def _check_layout(st, spec, ref, what):
    """Every local shard holds exactly its box of ``ref`` and matches the spec's metadata."""
    rank = torch.distributed.get_rank()
    expected = [m.shard_sizes for m in spec.build_metadata(SIZE) if m.rank == rank]
    assert [s.metadata.shard_sizes for s in st.local_shards()] == expected, what
    for s in st.local_shards():
        assert torch.equal(s.tensor, ref[s.metadata.region()]), f"{what}: {s.metadata}"


def _creation_body(ctx):
    ws = ctx.world_size
    for name, make in ALL.items():
        spec = make(ws)
        for fn, draw in ((st_api.rand, torch.rand), (st_api.randn, torch.randn)):
            torch.manual_seed(7)
            st = fn(spec, *SIZE)
            after = torch.rand(3)
            torch.manual_seed(7)
            ref = draw(*SIZE)
            assert torch.equal(st.full_tensor(), ref), f"{fn.__name__} {name}"
            assert torch.equal(after, torch.rand(3)), f"{fn.__name__} {name}: RNG out of step"
            _check_layout(st, spec, ref, f"{fn.__name__} {name}")
            dst = ws - 1
            gathered = st.gather(dst)
            assert (gathered is None) == (ctx.rank != dst)
            if gathered is not None:
                assert torch.equal(gathered, ref)
        for fn, value in ((st_api.zeros, 0.0), (st_api.ones, 1.0)):
            st = fn(spec, *SIZE, dtype=torch.float64)
            assert st.dtype == torch.float64 and st.size() == torch.Size(SIZE)
            assert torch.equal(st.full_tensor(), torch.full(SIZE, value, dtype=torch.float64))
        empty = st_api.empty(spec, *SIZE)
        assert [s.tensor.shape for s in empty.local_shards()] == \
            [torch.Size(m.shard_sizes) for m in empty.metadata().on_rank(ctx.rank)]
        # scatter from the last rank; the others pass values that must be ignored
        torch.manual_seed(3)
        ref = torch.randn(*SIZE)
        mine = ref if ctx.rank == ws - 1 else torch.full(SIZE, float("nan"))
        st = st_api.shard_tensor(mine, spec, src_rank=ws - 1)
        _check_layout(st, spec, ref, f"shard_tensor {name}")
        # wrap local shards cut from the reference
        local = [Shard(ref[m.region()].clone(), m) for m in spec.build_metadata(SIZE)
                 if m.rank == ctx.rank]
        st = st_api.init_from_local_shards(local, *SIZE)
        assert torch.equal(st.full_tensor(), ref), f"init_from_local_shards {name}"
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_creation_gather_and_scatter_equal_dense(world_size):
    run_on_ranks(world_size, _creation_body)


def _reshard_body(ctx):
    ws = ctx.world_size
    torch.manual_seed(11)
    ref = torch.randn(*SIZE)
    collectives = {}
    for a_name, a in ALL.items():
        for b_name, b in ALL.items():
            st = st_api.shard_tensor(ref, a(ws))
            with CommCounter() as comm:
                out = st.reshard(b(ws))
            collectives[(a_name, b_name)] = comm.get("all_to_all").calls
            assert out is st and st.sharding_spec() == b(ws)
            _check_layout(st, b(ws), ref, f"reshard {a_name} -> {b_name}")
            assert torch.equal(st.full_tensor(), ref)
    return collectives


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reshard_between_every_pair_of_specs_uses_at_most_one_collective(world_size):
    for counts in run_on_ranks(world_size, _reshard_body):
        assert all(c <= 1 for c in counts.values()), counts
        if world_size > 1:
            assert counts[("rows", "cols")] == 1 and counts[("rows", "rows")] == 0


def _elementwise_body(ctx):
    ws = ctx.world_size
    results = []
    for name in ("rows", "cols", "grid"):
        spec = ALL[name](ws)
        torch.manual_seed(5)
        a = st_api.randn(spec, *SIZE, requires_grad=True)
        b = st_api.rand(spec, *SIZE, requires_grad=True)
        torch.manual_seed(5)
        ra = torch.randn(*SIZE).requires_grad_()
        rb = torch.rand(*SIZE).requires_grad_()
        torch.manual_seed(9)
        row = torch.randn(SIZE[1]).requires_grad_()
        ref_row = row.detach().clone().requires_grad_()

        def f(x, y, r):
            z = F.gelu(x) * 2 + x * r - 1.5
            z = torch.tanh(z) / (y + 1) + F.relu(y - 0.5) - x
            return z

        z, rz = f(a, b, row), f(ra, rb, ref_row)
        assert isinstance(z, ShardedTensor)
        assert_rel_close(z.full_tensor(), rz, RTOL, f"{name}: element-wise")
        loss = z.sum() * 0.5 + (z * z).mean() + z.amax() - z.amin()
        ref_loss = rz.sum() * 0.5 + (rz * rz).mean() + rz.amax() - rz.amin()
        if name != "grid":  # chunked: reductions over one dim
            loss = loss + (z.sum(dim=0) ** 2).sum() + (z.mean(dim=1, keepdim=True) ** 2).sum()
            loss = loss + z.amax(dim=1 - spec.dim).sum()
            ref_loss = ref_loss + (rz.sum(dim=0) ** 2).sum() + \
                (rz.mean(dim=1, keepdim=True) ** 2).sum() + rz.amax(dim=1 - spec.dim).sum()
            sm = F.softmax(z, dim=1 - spec.dim)
            assert_rel_close(sm.full_tensor(), F.softmax(rz, dim=1 - spec.dim), RTOL, "softmax")
        assert_rel_close(loss, ref_loss, RTOL, f"{name}: loss")
        loss.backward()
        ref_loss.backward()
        for st, r, what in ((a, ra, "a"), (b, rb, "b")):
            for s in st.local_shards():
                assert_rel_close(s.tensor.grad, r.grad[s.metadata.region()], RTOL,
                                 f"{name}: grad of {what} {s.metadata.describe()}")
        if name != "grid" or ws in (1, 4):  # below 4 ranks grid leaves no rank empty anyway
            assert_rel_close(row.grad, ref_row.grad, RTOL, f"{name}: grad of the whole operand")
        with torch.no_grad():  # in place, as an optimizer would
            a.mul_(2).add_(b)
            ra.mul_(2).add_(rb)
        assert_rel_close(a.full_tensor(), ra, RTOL, f"{name}: in place")
        results.append(name)
    return results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_elementwise_and_reductions_equal_dense_with_grads(world_size):
    run_on_ranks(world_size, _elementwise_body)


def _errors_body(ctx):
    ws = ctx.world_size
    spec = rows(ws)
    st = st_api.rand(spec, *SIZE)
    messages = {}

    def expect(exc, key, fn):
        try:
            fn()
        except exc as err:
            messages[key] = str(err)
            return
        raise AssertionError(f"{key}: no {exc.__name__} raised")

    expect(UnsupportedShardedOp, "cumsum", lambda: torch.cumsum(st, 0))
    expect(UnsupportedShardedOp, "method", lambda: st.t())
    if ws > 1:  # on one rank no dim is split
        expect(UnsupportedShardedOp, "softmax", lambda: F.softmax(st, dim=0))
    expect(UnsupportedShardedOp, "layouts", lambda: st + st_api.rand(ALL["grid"](ws), *SIZE))
    expect(UnsupportedShardedOp, "dropout", lambda: F.dropout(st, 0.1))
    expect(ShardingError, "ranks", lambda: st_api.zeros(rows(ws + 1), *SIZE))
    # this rank's shard claims a box that another rank also claims
    overlapping = [Shard(torch.zeros(4, 5), ShardMetadata((0, 0), (4, 5), f"rank:{ctx.rank}"))]
    expect(ShardingError, "overlap" if ws > 1 else "missing",
           lambda: st_api.init_from_local_shards(overlapping, *SIZE))
    wrong_rank = [Shard(torch.zeros(7, 5), ShardMetadata((0, 0), (7, 5), f"rank:{ws}"))]
    expect(ShardingError, "wrong_rank", lambda: st_api.init_from_local_shards(wrong_rank, *SIZE))
    return messages


@pytest.mark.parametrize("world_size", (1, 2))
def test_bad_input_gets_a_clear_error(world_size):
    msgs = run_on_ranks(world_size, _errors_body)[0]
    assert "torch.cumsum has no sharded implementation for (7, 5) ChunkShardingSpec(dim=0" \
        in msgs["cumsum"]
    assert "torch.Tensor.t has no sharded implementation" in msgs["method"]
    if world_size > 1:
        assert "dim 0 is split across shards" in msgs["softmax"]
    assert "same layout" in msgs["layouts"] and "EnumerableShardingSpec" in msgs["layouts"]
    assert "random masks" in msgs["dropout"]
    assert f"Global rank {world_size} does not exist in input process group" in msgs["ranks"]
    if world_size > 1:
        assert "overlap" in msgs["overlap"]
    else:
        assert "cover 20 of the 35 elements" in msgs["missing"]
    assert "placed on rank" in msgs["wrong_rank"] and "not on this rank" in msgs["wrong_rank"]
