"""Sharded ``F.embedding``: the table chunked on the vocabulary (dim 0) or on the embedding dim.

- Vocabulary (dim 0): each rank looks up the ids that fall in its rows (others read row 0 and
  are zeroed), and the partial results are all-reduced (forward); the gradient of the whole
  output reaches every rank's rows unchanged (backward: no collective). Ranks with no rows
  contribute zeros.
- Embedding dim (dim 1): each rank looks up its columns for every id and the slices are
  all-gathered into the whole embedding (forward); backward keeps this rank's columns.

``padding_idx`` is honoured (its row gets no gradient); ``max_norm``, ``scale_grad_by_freq`` and
``sparse`` are refused with an error: each would need more than one rank's rows or counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.sharded_tensor import comm
from shardwise.sharded_tensor.dispatch import implements, unsupported
from shardwise.sharded_tensor.layout import bind, chunk_dim, rank_chunks
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor

_NAMES = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
          "sparse")


@implements(F.embedding)
def embedding(func, args, kwargs):
    a = bind(args, kwargs, _NAMES, norm_type=2.0, scale_grad_by_freq=False, sparse=False)
    idx, w = a["input"], a["weight"]
    if isinstance(idx, ShardedTensor) or not isinstance(w, ShardedTensor) or w.dim() != 2:
        raise unsupported(func, (args, kwargs), "needs whole ids and a 2D sharded table")
    for name in ("max_norm", "scale_grad_by_freq", "sparse"):
        if a[name]:
            raise unsupported(func, (args, kwargs), f"{name}={a[name]!r} is not supported")
    pad = a["padding_idx"]
    if pad is not None and pad < 0:
        pad += w.size(0)
    if chunk_dim(func, w, (args, kwargs)) == 0:
        return _vocab_sharded(idx, w, pad)
    offsets, sizes = rank_chunks(w, 1)
    local = F.embedding(idx, w.local_tensor(), padding_idx=pad)
    return comm.gather_from_parallel(local, -1, offsets, sizes, w.process_group)


def _vocab_sharded(idx: torch.Tensor, w: ShardedTensor, pad: int | None) -> torch.Tensor:
    group = w.process_group
    rank = dist.get_rank(group)
    offsets, sizes = rank_chunks(w, 0)
    lo, n = offsets[rank], sizes[rank]
    table = w.local_tensor()  # (n, embedding_dim): rows lo .. lo + n
    if n == 0:
        out = table.new_zeros((*idx.shape, table.shape[1]))
    else:
        outside = (idx < lo) | (idx >= lo + n)
        local_pad = pad - lo if pad is not None and lo <= pad < lo + n else None
        out = F.embedding((idx - lo).masked_fill(outside, 0), table, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return comm.reduce_from_parallel(out, group)
