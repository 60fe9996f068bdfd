"""Tensor-parallel ops against dense single-process references: forward outputs and every
gradient within 1e-6 relative, on 1, 2 and 4 ranks, with dims that do not divide evenly (several
of them leave a rank an empty chunk)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise.sharded_tensor as st_api
from shardwise.distributed import CommCounter
from shardwise.sharded_tensor import ChunkShardingSpec, ShardedTensor
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

RTOL = 1e-6


def _spec(dim, ws):
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in range(ws)])


def _sharded_leaf(t, dim, ws):
    """Shard ``t`` on ``dim``; the local shard becomes a leaf that accumulates a gradient."""
    st = st_api.shard_tensor(t.detach(), _spec(dim, ws))
    st.local_tensor().requires_grad_()
    return st


def _region(st):
    return st.local_shards()[0].metadata.region()


def _close_grad(st, ref, what):
    local = st.local_tensor()
    expected = ref.grad[_region(st)]
    got = local.grad if local.grad is not None else torch.zeros_like(local)
    assert_rel_close(got, expected, RTOL, f"grad of {what}")


def _dense(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _linear_body(ctx, d_in, d_out):
    ws = ctx.world_size
    x, w, b = _dense(2, 3, d_in, seed=1), _dense(d_out, d_in, seed=2), _dense(d_out, seed=3)
    g = _dense(2, 3, d_out, seed=4).detach()  # upstream gradient of the output
    ref = F.linear(x, w, b)
    (ref * g).sum().backward()

    # column-wise: weight and bias chunked on the output features; output stays this rank's slice
    xc = x.detach().clone().requires_grad_()
    wc, bc = _sharded_leaf(w, 0, ws), _sharded_leaf(b, 0, ws)
    y = F.linear(xc, wc, bc)
    out_slice = _region(wc)[0]
    assert_rel_close(y, ref[..., out_slice], RTOL, "colwise output")
    (y * g[..., out_slice]).sum().backward()
    assert_rel_close(xc.grad, x.grad, RTOL, "colwise grad of input")
    _close_grad(wc, w, "colwise weight")
    _close_grad(bc, b, "colwise bias")

    # row-wise, input whole: weight chunked on the input features, bias whole
    xr = x.detach().clone().requires_grad_()
    wr = _sharded_leaf(w, 1, ws)
    br = b.detach().clone().requires_grad_()
    y = F.linear(xr, wr, br)
    assert_rel_close(y, ref, RTOL, "rowwise output")
    (y * g).sum().backward()
    assert_rel_close(xr.grad, x.grad, RTOL, "rowwise grad of whole input")
    _close_grad(wr, w, "rowwise weight")
    assert_rel_close(br.grad, b.grad, RTOL, "rowwise bias")

    # row-wise, input already sliced (what a column-wise layer hands over)
    in_slice = _region(wr)[1]
    xs = x.detach()[..., in_slice].clone().requires_grad_()
    y = F.linear(xs, _sharded_leaf(w, 1, ws), b.detach())
    assert_rel_close(y, ref, RTOL, "rowwise output from a sliced input")
    (y * g).sum().backward()
    assert_rel_close(xs.grad, x.grad[..., in_slice], RTOL, "rowwise grad of sliced input")
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_linear_colwise_and_rowwise_equal_dense(world_size):
    # 7 -> 5: 5 over 4 ranks leaves rank 3 no output features; 7 over 2 or 4 is uneven
    run_on_ranks(world_size, _linear_body, 7, 5)


def _mlp_body(ctx, d, hidden):
    ws = ctx.world_size
    x = _dense(2, 4, d, seed=10)
    w1, b1, w2, b2 = (_dense(hidden, d, seed=11), _dense(hidden, seed=12),
                      _dense(d, hidden, seed=13), _dense(d, seed=14))
    g = _dense(2, 4, d, seed=15).detach()
    ref = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    (ref * g).sum().backward()

    xs = x.detach().clone().requires_grad_()
    s1, sb1, s2 = _sharded_leaf(w1, 0, ws), _sharded_leaf(b1, 0, ws), _sharded_leaf(w2, 1, ws)
    sb2 = b2.detach().clone().requires_grad_()
    with CommCounter() as comm:
        h = F.gelu(F.linear(xs, s1, sb1))  # this rank's slice of the hidden features
        y = F.linear(h, s2, sb2)
    forward = comm.per_kind("calls")
    assert_rel_close(y, ref, RTOL, "MLP output")
    with CommCounter() as comm:
        (y * g).sum().backward()
    backward = comm.per_kind("calls")
    assert_rel_close(xs.grad, x.grad, RTOL, "MLP grad of input")
    for st, r, what in ((s1, w1, "fc1.weight"), (sb1, b1, "fc1.bias"), (s2, w2, "fc2.weight")):
        _close_grad(st, r, what)
    assert_rel_close(sb2.grad, b2.grad, RTOL, "fc2.bias")
    return forward, backward


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_colwise_then_rowwise_mlp_one_all_reduce_each_way(world_size):
    # hidden 10 over 4 ranks: 3, 3, 3, 1; over 2: 5, 5; d 6 over 4: 2, 2, 2, 0
    for forward, backward in run_on_ranks(world_size, _mlp_body, 6, 10):
        expected = {"all_reduce": 1} if world_size > 1 else {}
        assert forward == expected and backward == expected, (forward, backward)


def _matmul_body(ctx):
    ws = ctx.world_size
    a, m = _dense(3, 7, seed=20), _dense(7, 5, seed=21)
    g = _dense(3, 5, seed=22).detach()
    ref = a @ m
    (ref * g).sum().backward()
    for dim in (0, 1):  # dense @ sharded, the sharded operand chunked on rows, then columns
        aa = a.detach().clone().requires_grad_()
        sm = _sharded_leaf(m, dim, ws)
        y = aa @ sm
        gy = g if dim == 0 else g[:, _region(sm)[1]]
        assert_rel_close(y, ref if dim == 0 else ref[:, _region(sm)[1]], RTOL, f"x @ W{dim}")
        (y * gy).sum().backward()
        assert_rel_close(aa.grad, a.grad, RTOL, f"x @ W{dim}: grad of x")
        _close_grad(sm, m, f"x @ W{dim}: W")
    for dim in (0, 1):  # sharded @ dense
        sa = _sharded_leaf(a, dim, ws)
        mm = m.detach().clone().requires_grad_()
        y = torch.matmul(sa, mm)
        if dim == 0:
            assert isinstance(y, ShardedTensor) and y.sharding_spec().dim == 0
            assert_rel_close(y.full_tensor(), ref, RTOL, "A0 @ m")
            (y * g).sum().backward()
        else:
            assert_rel_close(y, ref, RTOL, "A1 @ m")
            (y * g).sum().backward()
        assert_rel_close(mm.grad, m.grad, RTOL, f"A{dim} @ m: grad of m")
        _close_grad(sa, a, f"A{dim} @ m: A")
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matmul_equals_dense(world_size):
    run_on_ranks(world_size, _matmul_body)


def _embedding_body(ctx, vocab, dim, padding_idx):
    ws = ctx.world_size
    table = _dense(vocab, dim, seed=30)
    idx = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(31))
    idx[0, :3] = torch.tensor([0, vocab - 1, padding_idx if padding_idx is not None else 1])
    g = _dense(3, 9, dim, seed=32).detach()
    ref = F.embedding(idx, table, padding_idx=padding_idx)
    (ref * g).sum().backward()
    for shard_dim in (0, 1):
        st = _sharded_leaf(table, shard_dim, ws)
        y = F.embedding(idx, st, padding_idx=padding_idx)
        assert_rel_close(y, ref, RTOL, f"embedding sharded on dim {shard_dim}")
        (y * g).sum().backward()
        _close_grad(st, table, f"embedding table sharded on dim {shard_dim}")
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("padding_idx", [None, 4])
def test_embedding_on_vocab_and_on_embedding_dim_equal_dense(world_size, padding_idx):
    # vocab 11 over 4: 3, 3, 3, 2; embedding dim 6 over 4: 2, 2, 2, 0
    run_on_ranks(world_size, _embedding_body, 11, 6, padding_idx)


def _unsupported_body(ctx):
    ws = ctx.world_size
    w = st_api.shard_tensor(torch.randn(5, 7), _spec(0, ws))
    messages = []
    for call in (lambda: F.conv1d(torch.randn(1, 7, 4), w),
                 lambda: F.linear(st_api.rand(_spec(1, ws), 3, 7), w),
                 lambda: F.embedding(torch.tensor([1]), w, max_norm=1.0),
                 lambda: F.linear(torch.randn(2, 6), st_api.shard_tensor(torch.randn(5, 7),
                                                                         _spec(1, ws)))):
        try:
            call()
        except st_api.UnsupportedShardedOp as err:
            messages.append(str(err))
        else:
            raise AssertionError("no error")
    return messages


@pytest.mark.parametrize("world_size", (2,))
def test_unsupported_ops_and_bad_shapes_name_op_and_sharding(world_size):
    conv, col_input, max_norm, width = run_on_ranks(world_size, _unsupported_body)[0]
    assert conv.startswith("torch.nn.functional.conv1d has no sharded implementation for (5, 7) "
                           "ChunkShardingSpec(dim=0"), conv
    assert "torch.nn.functional.linear" in col_input and "whole (replicated) input" in col_input
    assert "max_norm=1.0 is not supported" in max_norm
    assert "input's last dim is 6; expected 7 (whole) or 4" in width
