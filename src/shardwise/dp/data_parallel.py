"""The data-parallel core that DDP, ZeRO and FSDP share (each used by all of them, written once).

- ``sync_module_state``: at wrap time rank 0's parameters and buffers reach every rank (one
  coalesced broadcast per dtype), so replicas start equal.
- ``buffers_to_sync`` / ``broadcast_buffers``: the buffer policy, torch DDP's rule: with
  ``broadcast_buffers=True`` every buffer of the module (every non-empty one: an empty buffer
  carries nothing) is broadcast from rank 0 before each forward that will reduce gradients.
- ``sharded_grad_norm`` and ``clip_by_total_norm``: the global gradient norm when each rank holds
  a disjoint part of the gradients (ZeRO stage 2's owned gradients, FSDP's shards): one
  all-reduce of the local sums of ``|g|^p`` (of the local max for the infinity norm), then every
  rank scales its own part by the same factor, as ``torch.nn.utils.clip_grad_norm_`` would
  scale the whole gradients.
- ``resolve_group``: torch's compatibility spellings of "the data-parallel group"
  (``process_group=`` or a 1D ``device_mesh=``; ``None`` is the world).
- Gradient bucket sizes (``BucketSizes``, ``MIB``) live with the buckets, in buckets.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.collectives import broadcast_coalesced
from shardwise.dp.buckets import MIB

__all__ = ["MIB", "broadcast_buffers", "buffers_to_sync", "clip_by_total_norm", "resolve_group",
           "sharded_grad_norm", "sync_module_state"]


def sync_module_state(module: nn.Module, group: dist.ProcessGroup | None,
                      src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to group rank ``src``'s (collective)."""
    tensors = [p.detach() for p in module.parameters()] + list(module.buffers())
    broadcast_coalesced(tensors, src, group)


def buffers_to_sync(module: nn.Module) -> list[torch.Tensor]:
    """The buffers a data-parallel wrapper broadcasts before forward (torch's rule: all)."""
    return [b for b in module.buffers() if b.numel()]


def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None, src: int = 0) -> None:
    """Every rank's buffers become group rank ``src``'s (one broadcast per dtype)."""
    buffers = buffers_to_sync(module)
    if buffers:
        broadcast_coalesced(buffers, src, group)


def sharded_grad_norm(grads: Sequence[torch.Tensor], norm_type: float,
                      group: dist.ProcessGroup | None, device: torch.device, *,
                      copies: Sequence[int] | None = None,
                      second_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of all ranks' ``grads`` together: a 0-dim float32 tensor, the
    same on every rank. Collective: one all-reduce (sum of ``|g|^p``, or max for the infinity
    norm) over ``group``, and one more over ``second_group`` when the gradients are split along
    a second mesh axis as well (tensor parallelism under FSDP).

    Each rank passes its disjoint part of every gradient. A part that several ranks of the two
    groups hold identically (a tensor-parallel replicated parameter) gives its number of holders
    in ``copies`` (one per gradient, default 1), so it counts once; the max ignores it."""
    norm_type = float(norm_type)
    weights = list(copies) if copies is not None else [1] * len(grads)
    if len(weights) != len(grads):
        raise ValueError(f"copies has {len(weights)} entries for {len(grads)} gradients")
    kept = [(g.detach(), n) for g, n in zip(grads, weights) if g.numel()]
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max().float() for g, _ in kept]).max() if kept else \
            torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    else:
        # at least float32 (16-bit gradients), float64 kept as float64
        terms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.promote_types(
            g.dtype, torch.float32)).pow(norm_type) / n for g, n in kept]
        local = torch.stack(terms).sum() if terms else torch.zeros((), device=device)
        op = dist.ReduceOp.SUM
    total = local.reshape(1).clone()
    axes = [group] if second_group is None else [group, second_group]
    for axis in axes:
        if dist.get_world_size(axis) > 1:
            dist.all_reduce(total, op=op, group=axis)
    return total[0] if math.isinf(norm_type) else total[0] ** (1.0 / norm_type)


def clip_by_total_norm(grads: Sequence[torch.Tensor], max_norm: float,
                       total: torch.Tensor) -> None:
    """Scale ``grads`` in place so that a total norm ``total`` becomes at most ``max_norm``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh: object | None,
                  owner: str) -> dist.ProcessGroup | None:
    """torch's ``process_group=`` or ``device_mesh=`` (a 1D mesh) as one process group."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise TypeError(f"{owner} takes process_group= or device_mesh=, not both")
    ndim = getattr(device_mesh, "ndim", None)
    if ndim != 1:
        shape = tuple(getattr(device_mesh, "shape", ()))
        raise ValueError(f"{owner} needs a 1D device_mesh, got a {ndim}D one of shape {shape}; "
                         "pass the data-parallel dimension, e.g. mesh['dp']")
    return device_mesh.get_group()  # type: ignore[attr-defined]
