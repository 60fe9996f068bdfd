"""Gradient-norm clipping across shards.

Each rank holds a disjoint part of every gradient (padding excluded), so the global norm is the
reduction over ranks of the local partial norms: the data-parallel core's ``sharded_grad_norm``
(shared with ZeRO stage 2), which all-reduces the sum of |g|^p (or the max for the infinity
norm) over the data-parallel group; under FSDP x TP over the 2D mesh's dp group and then its
tp group (see [Note: FSDP x TP], tp_params.py), counting a TP-replicated gradient once. Every
rank then scales its own shards by the same factor, exactly as
``torch.nn.utils.clip_grad_norm_`` would scale the unsharded gradients.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.groups import global_ranks
from shardwise.dp.data_parallel import clip_by_total_norm, sharded_grad_norm
from shardwise.fsdp import tp_params
from shardwise.fsdp.layout import local_tensor


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, process_group: dist.ProcessGroup | None = None
                    ) -> torch.Tensor:
    """Clip the gradients of sharded ``parameters`` (a module or its ``parameters()``) to a
    total ``norm_type`` norm of ``max_norm``; returns the total norm (same on every rank).
    Collective over ``process_group`` (default: the world group); for FSDP x TP parameters
    over the dp and tp groups of their 2D mesh."""
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    groups = tp_params.mesh_groups_of(params)  # FSDP x TP: (dp, tp) from the 2D mesh
    if groups is None:
        groups = (process_group or dist.group.WORLD, None)
    elif process_group not in (None, dist.group.WORLD) and \
            global_ranks(process_group) != global_ranks(groups[0]):
        raise ValueError("clip_grad_norm_: the parameters are FSDP x TP DTensors on a (dp, tp) "
                         "mesh; process_group must be None or that mesh's dp group")
    copies = [tp_params.tp_copies(p.grad) for p in params if p.grad is not None]
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = sharded_grad_norm(grads, norm_type, groups[0], device, copies=copies,
                              second_group=groups[1])
    clip_by_total_norm(grads, max_norm, total)
    return total
