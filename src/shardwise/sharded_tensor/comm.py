"""The collectives sharded tensors use, autograd-aware where a gradient flows through them.

[Note: tensor-parallel collectives] A column-wise sharded linear (weight cut on its output
features) needs its input whole on every rank and yields this rank's slice of the output; a
row-wise sharded one (weight cut on its input features) takes this rank's slice of the input and
yields a partial sum. Chained (the Megatron MLP), the slice stays local between them, so the pair
costs one all-reduce in forward (``reduce_from_parallel`` after the row-wise layer: all-reduce
forward, identity backward) and one in backward (``copy_to_parallel`` before the column-wise
layer: identity forward, all-reduce backward: each rank's input gradient is a partial sum over its
slice of the output features). ``gather_from_parallel`` (all-gather forward, keep-my-slice
backward) turns a column-sliced output whole again; ``scatter_to_parallel`` (keep-my-slice
forward, all-gather backward) feeds a whole input to a row-wise layer. On one rank all four are
the identity and no collective is made.

What these collectives send is counted, where a test or the benchmark asks, by
``shardwise.distributed.CommCounter`` around the code that issues them; nothing is counted here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from shardwise._compat import dist_all_gather

_all_gather_single = dist_all_gather  # [Note: torch compatibility] in _compat.py


def world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place, and returned; nothing is sent on one rank."""
    if world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_to_all_flat(send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                    group) -> torch.Tensor:
    """One ``all_to_all_single`` of a 1D buffer: ``send_counts[r]`` elements go to rank r."""
    recv = send.new_empty(sum(recv_counts))
    if world(group) == 1:
        recv.copy_(send)
        return recv
    dist.all_to_all_single(recv, send, list(recv_counts), list(send_counts), group=group)
    return recv


def all_gather_dim(x: torch.Tensor, dim: int, offsets: Sequence[int], sizes: Sequence[int],
                   group) -> torch.Tensor:
    """The whole of ``dim`` on every rank: rank r's ``x`` holds ``sizes[r]`` rows of it starting
    at ``offsets[r]``. Uneven pieces are padded to the largest so one all-gather
    carries them all; pieces are put in offset order."""
    if world(group) == 1:
        return x
    dim = dim % x.dim()
    pad = max(sizes)
    front = x.movedim(dim, 0)
    padded = front.new_zeros((pad, *front.shape[1:]))
    padded[: front.shape[0]] = front
    out = padded.new_empty((pad * len(sizes), *front.shape[1:]))
    _all_gather_single(out, padded, group=group)
    order = sorted(range(len(sizes)), key=lambda r: offsets[r])
    pieces = [out[r * pad : r * pad + sizes[r]] for r in order]
    return torch.cat(pieces).movedim(0, dim)


class _CopyToParallel(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromParallel(Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous() or x._base is not None:
            return all_reduce(x.contiguous().clone(), group)
        ctx.mark_dirty(x)  # a fresh partial result: reduce it in place, no copy
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(Function):
    @staticmethod
    def forward(ctx, x, dim, offsets, sizes, rank, group):
        ctx.dim, ctx.offset, ctx.size = dim, offsets[rank], sizes[rank]
        return all_gather_dim(x, dim, offsets, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.offset, ctx.size), None, None, None, None, None


class _ScatterToParallel(Function):
    @staticmethod
    def forward(ctx, x, dim, offsets, sizes, rank, group):
        ctx.dim, ctx.offsets, ctx.sizes, ctx.group = dim, offsets, sizes, group
        return x.narrow(dim, offsets[rank], sizes[rank]).clone()

    @staticmethod
    def backward(ctx, grad):
        full = all_gather_dim(grad.contiguous(), ctx.dim, ctx.offsets, ctx.sizes, ctx.group)
        return full, None, None, None, None, None


def copy_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient in backward (see the Note above)."""
    return x if world(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return x if world(group) == 1 else _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, dim: int, offsets: Sequence[int],
                         sizes: Sequence[int], group) -> torch.Tensor:
    """All-gather along ``dim`` forward (rank r holds ``sizes[r]`` rows from ``offsets[r]``);
    keep my slice of the gradient backward."""
    if world(group) == 1:
        return x
    return _GatherFromParallel.apply(x, dim % x.dim(), list(offsets), list(sizes),
                                     dist.get_rank(group), group)


def scatter_to_parallel(x: torch.Tensor, dim: int, offsets: Sequence[int], sizes: Sequence[int],
                        group) -> torch.Tensor:
    """Keep my slice of ``dim`` forward; all-gather the gradient backward."""
    if world(group) == 1:
        return x
    return _ScatterToParallel.apply(x, dim % x.dim(), list(offsets), list(sizes),
                                    dist.get_rank(group), group)
