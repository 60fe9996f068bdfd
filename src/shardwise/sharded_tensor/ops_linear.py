"""Sharded ``F.linear`` and ``matmul``: the Megatron column-wise / row-wise pair.

See [Note: tensor-parallel collectives] in comm.py. For ``F.linear(x, weight, bias)`` with the
weight (out_features, in_features) chunked over the group's ranks:

- column-wise, weight chunked on dim 0: the input is whole on every rank; the result is this
  rank's slice of the output features as a plain tensor (``..., out_local``), no collective in
  forward, an all-reduce of the input's gradient in backward. The bias is a ShardedTensor with
  the same chunks (``shard_module`` shards it so) or a whole tensor of which this rank's slice is
  used.
- row-wise, weight chunked on dim 1: the input is either this rank's slice of the input features
  (last dim == this rank's chunk: the output of a column-wise layer, used as is) or whole (last
  dim == in_features: each rank keeps its slice, and the input's gradient is all-gathered in
  backward). The partial products are all-reduced in forward; the bias (whole) is added after.

The column-wise output stays a plain local tensor so that code between the two layers (GELU, the
attention's per-head reshapes) runs unchanged on this rank's slice; the demo GPT counts its
heads from that width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise._compat import nn_linear
from shardwise.sharded_tensor import comm
from shardwise.sharded_tensor.dispatch import implements, unsupported
from shardwise.sharded_tensor.layout import bind, chunk_dim, rank_chunks
from shardwise.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor, resolved_metadata
from shardwise.sharded_tensor.spec import ChunkShardingSpec


def _local_slice_of_input(func, x, st: ShardedTensor, dim: int, args) -> torch.Tensor:
    """This rank's slice of ``x``'s last dim matching ``st``'s chunks along ``dim``."""
    group = st.process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    offsets, sizes = rank_chunks(st, dim)
    full = st.size(dim)
    if isinstance(x, ShardedTensor):
        if chunk_dim(func, x, args) != x.dim() - 1 or rank_chunks(x, x.dim() - 1) != (
                offsets, sizes):
            raise unsupported(func, args, "a sharded input must be chunked on its last dim "
                              "exactly as the weight's contracted dim")
        return x.local_tensor()
    if world > 1 and max(sizes) == full:
        raise unsupported(func, args, f"a contracted dim of {full} over {world} ranks leaves "
                          "one rank all of it, so a whole and a sliced input look alike; "
                          "pass the input as a ShardedTensor")
    width = x.shape[-1]
    if world > 1 and width == full:
        return comm.scatter_to_parallel(x, -1, offsets, sizes, group)
    if width == sizes[rank]:
        return x
    raise unsupported(func, args, f"rank {rank}: the input's last dim is {width}; expected "
                      f"{full} (whole) or {sizes[rank]} (this rank's slice)")


def _colwise(func, x, w: ShardedTensor, bias, args, out_dim: int) -> torch.Tensor:
    """``x @ w_local`` with x whole; ``out_dim`` is the weight's output dim (0 for F.linear)."""
    if isinstance(x, ShardedTensor):
        raise unsupported(func, args, "a column-wise sharded weight needs a whole (replicated) "
                          "input; call full_tensor() on it first")
    group = w.process_group
    x = comm.copy_to_parallel(x, group)
    local_bias = _local_bias(func, bias, w, out_dim, args)
    if out_dim == 0:
        return F.linear(x, w.local_tensor(), local_bias)
    y = torch.matmul(x, w.local_tensor())
    return y if local_bias is None else y + local_bias


def _local_bias(func, bias, w: ShardedTensor, out_dim: int, args):
    if bias is None:
        return None
    rank = dist.get_rank(w.process_group)
    offsets, sizes = rank_chunks(w, out_dim)
    if isinstance(bias, ShardedTensor):
        if chunk_dim(func, bias, args) != 0 or rank_chunks(bias, 0) != (offsets, sizes):
            raise unsupported(func, args, "the bias must be chunked like the weight's output dim")
        return bias.local_tensor()
    return bias.narrow(-1, offsets[rank], sizes[rank])


def _rowwise(func, x, w: ShardedTensor, bias, args, in_dim: int) -> torch.Tensor:
    if isinstance(bias, ShardedTensor):
        raise unsupported(func, args, "a row-wise sharded weight takes a whole bias (it is "
                          "added after the all-reduce)")
    x_local = _local_slice_of_input(func, x, w, in_dim, args)
    w_local = w.local_tensor()
    partial = F.linear(x_local, w_local) if in_dim == 1 else torch.matmul(x_local, w_local)
    y = comm.reduce_from_parallel(partial, w.process_group)
    return y if bias is None else y + bias


@implements(F.linear, nn_linear)
def linear(func, args, kwargs):
    a = bind(args, kwargs, ("input", "weight", "bias"))
    x, w, b = a["input"], a["weight"], a["bias"]
    if not isinstance(w, ShardedTensor) or w.dim() != 2:
        raise unsupported(func, (args, kwargs), "only a 2D sharded weight is supported")
    dim = chunk_dim(func, w, (args, kwargs))
    if dim == 0:
        return _colwise(func, x, w, b, (args, kwargs), out_dim=0)
    return _rowwise(func, x, w, b, (args, kwargs), in_dim=1)


@implements(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__)
def matmul(func, args, kwargs):
    a, b = args[0], args[1]
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        raise unsupported(func, args, "both operands sharded: reshard one or gather it")
    if isinstance(b, ShardedTensor):
        if b.dim() != 2:
            raise unsupported(func, args, "a sharded right operand must be 2D")
        if chunk_dim(func, b, args) == 1:
            return _colwise(func, a, b, None, args, out_dim=1)
        return _rowwise(func, a, b, None, args, in_dim=0)
    return _sharded_left(func, a, b, args)


def _sharded_left(func, a: ShardedTensor, b: torch.Tensor, args):
    """``a @ b`` with ``a`` (m, k) chunked on rows (result rows sharded, no forward collective)
    or on k (partial products all-reduced into a whole result)."""
    if a.dim() != 2 or b.dim() not in (1, 2):
        raise unsupported(func, args, "a sharded left operand must be 2D and the right 1D or 2D")
    dim, group = chunk_dim(func, a, args), a.process_group
    if dim == 1:
        offsets, sizes = rank_chunks(a, 1)
        b_local = comm.scatter_to_parallel(b, 0, offsets, sizes, group)
        return comm.reduce_from_parallel(torch.matmul(a.local_tensor(), b_local), group)
    local = torch.matmul(a.local_tensor(), comm.copy_to_parallel(b, group))
    size = (a.size(0),) + ((b.shape[1],) if b.dim() == 2 else ())
    spec = ChunkShardingSpec(0, a.sharding_spec().placements)
    return _new_sharded(local, spec, size, a)


def _new_sharded(local: torch.Tensor, spec, size, like: ShardedTensor) -> ShardedTensor:
    metas = resolved_metadata(spec, size, like.process_group)
    meta = ShardedTensorMetadata(metas, size, TensorProperties(local.dtype, local.requires_grad))
    return like._with_local([local], spec=spec, meta=meta)
