"""Gradient-norm clipping across shards.

Each rank holds a disjoint part of every gradient (padding excluded), so the global norm is the
reduction over ranks of the local partial norms: an all-reduce of the sum of |g|^p (or of the max
for the infinity norm). Every rank then scales its own shards by the same factor, exactly as
``torch.nn.utils.clip_grad_norm_`` would scale the unsharded gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.fsdp import tp_compose
from shardwise.fsdp.collectives import all_reduce_now
from shardwise.fsdp.dtensor import local_tensor


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, process_group: dist.ProcessGroup | None = None
                    ) -> torch.Tensor:
    """Clip the gradients of sharded ``parameters`` (a module or its ``parameters()``) to a
    total ``norm_type`` norm of ``max_norm``; returns the total norm (same on every rank).
    Collective over ``process_group`` (default: the world group)."""
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    tp_group = tp_compose.tp_group_of(params)
    copies = [tp_compose.tp_copies(p.grad) for p in params if p.grad is not None]
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    group = process_group or dist.group.WORLD
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.detach().abs().max() for g in grads if g.numel()),
                    default=torch.zeros((), device=device)).float()
        total = all_reduce_now(local.reshape(1).clone(), group, dist.ReduceOp.MAX)
        if tp_group is not None:
            total = all_reduce_now(total, tp_group, dist.ReduceOp.MAX)
        total = total[0]
    else:
        local = sum((g.detach().float().abs().pow(norm_type).sum() / n
                     for g, n in zip(grads, copies)), torch.zeros((), device=device))
        total = all_reduce_now(local.reshape(1), group)
        if tp_group is not None:
            total = all_reduce_now(total, tp_group)
        total = total[0] ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
