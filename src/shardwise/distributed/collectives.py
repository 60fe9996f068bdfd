"""Collective helpers: coalesced (flattened) versions of per-tensor collectives.

One collective on a flat buffer costs one round of latency; many small tensors sent one by one
cost one each. These helpers flatten tensors of one dtype and device into a buffer, run a single
collective on it, and copy the result back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split ``tensors`` into lists that share dtype and device, keeping their order."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    return list(groups.values())


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1D buffer holding ``tensors`` back to back (all of one dtype and device)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (the inverse of ``flatten``)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int,
                        group: dist.ProcessGroup | None = None) -> None:
    """Make every rank's ``tensors`` equal to rank ``src``'s: one broadcast per dtype."""
    if group is not None and dist.get_world_size(group) == 1:
        return
    for same in group_by_dtype(list(tensors)):
        flat = flatten(same)
        dist.broadcast(flat, src=dist.get_global_rank(group, src) if group else src, group=group)
        unflatten_into(flat, same)
