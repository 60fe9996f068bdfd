"""Reductions: sum, mean, max/min (whole tensor, any spec) and sum/mean/amax/amin over one dim.

- Whole-tensor ``sum``/``mean``: each rank sums its shards and one all-reduce adds the partial
  sums (backward: no collective, every element's gradient is the output's). The result is a
  plain (replicated) scalar.
- Whole-tensor ``max``/``min``/``amax``/``amin``: each rank's extreme (or the identity when it
  holds nothing) is all-gathered and the extreme of those taken, so the gradient reaches the
  element that won (backward keeps this rank's entry).
- Over one dim of a ChunkShardingSpec tensor: along the chunked dim, partial sums are
  all-reduced into a plain tensor (``sum``/``mean``; ``amax``/``amin`` there are refused); along
  another dim each shard reduces locally and the result stays sharded, chunked as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.sharded_tensor import comm
from shardwise.sharded_tensor.dispatch import implements, unsupported
from shardwise.sharded_tensor.layout import chunk_dim
from shardwise.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor, resolved_metadata
from shardwise.sharded_tensor.spec import ChunkShardingSpec

T = torch.Tensor
_SUM = (torch.sum, T.sum)
_MEAN = (torch.mean, T.mean)
_MAX = (torch.max, T.max, torch.amax, T.amax)
_MIN = (torch.min, T.min, torch.amin, T.amin)


def _dim_arg(args, kwargs):
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return "many"
        dim = dim[0]
    return dim


@implements(*_SUM, *_MEAN)
def sum_mean(func, args, kwargs):
    st: ShardedTensor = args[0]
    dim = _dim_arg(args, kwargs)
    if kwargs.get("dtype") is not None:
        raise unsupported(func, (args, kwargs), "dtype= is not supported")
    if dim == "many":
        raise unsupported(func, (args, kwargs), "reduce over one dim or all dims")
    mean = func in _MEAN
    if dim is None:
        return _whole_sum(st, mean)
    return _over_dim(func, args, kwargs, st, dim % st.dim(), mean)


def _whole_sum(st: ShardedTensor, mean: bool) -> torch.Tensor:
    parts = [s.tensor.sum() for s in st.local_shards()]
    local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=st.dtype,
                                                                 device=st.device)
    total = comm.reduce_from_parallel(local, st.process_group)
    return total / st.numel() if mean else total


def _over_dim(func, args, kwargs, st: ShardedTensor, dim: int, mean: bool):
    keep = bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
    local = st.local_tensor()
    if dim == chunk_dim(func, st, (args, kwargs)):
        partial = local.sum(dim, keepdim=keep)
        total = comm.reduce_from_parallel(partial, st.process_group)
        return total / st.size(dim) if mean else total
    out = local.mean(dim, keepdim=keep) if mean else local.sum(dim, keepdim=keep)
    return _reduced_sharded(st, out, dim, keep)


def _reduced_sharded(st: ShardedTensor, out: torch.Tensor, dim: int, keep: bool):
    sharded = st.sharding_spec().sharded_dim(st.dim())
    size = list(st.shape)
    if keep:
        size[dim] = 1
    else:
        del size[dim]
        sharded -= dim < sharded
    spec = ChunkShardingSpec(sharded, st.sharding_spec().placements)
    metas = resolved_metadata(spec, size, st.process_group)
    meta = ShardedTensorMetadata(metas, size, TensorProperties(out.dtype, out.requires_grad))
    return st._with_local([out], spec=spec, meta=meta)


@implements(*_MAX, *_MIN)
def extreme(func, args, kwargs):
    st: ShardedTensor = args[0]
    dim = _dim_arg(args, kwargs)
    is_max = func in _MAX
    if dim is not None:
        if func in (torch.max, T.max, torch.min, T.min):
            raise unsupported(func, (args, kwargs), "max/min over a dim (values and indices) "
                              "is not supported; use amax/amin")
        return _extreme_over_dim(func, args, kwargs, st, dim % st.dim(), is_max)
    parts = [s.tensor.amax() if is_max else s.tensor.amin()
             for s in st.local_shards() if s.tensor.numel()]
    fill = float("-inf") if is_max else float("inf")
    if st.dtype.is_floating_point is False:
        info = torch.iinfo(st.dtype)
        fill = info.min if is_max else info.max
    local = (torch.stack(parts).amax() if is_max else torch.stack(parts).amin()) if parts \
        else torch.full((), fill, dtype=st.dtype, device=st.device)
    world = dist.get_world_size(st.process_group)
    every = comm.gather_from_parallel(local.reshape(1), 0, list(range(world)), [1] * world,
                                      st.process_group)
    return every.amax() if is_max else every.amin()


def _extreme_over_dim(func, args, kwargs, st: ShardedTensor, dim: int, is_max: bool):
    if dim == chunk_dim(func, st, (args, kwargs)):
        raise unsupported(func, (args, kwargs), "amax/amin over the chunked dim is not "
                          "supported; reduce over another dim or over the whole tensor")
    keep = bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
    local = st.local_tensor()
    out = local.amax(dim, keepdim=keep) if is_max else local.amin(dim, keepdim=keep)
    return _reduced_sharded(st, out, dim, keep)
