"""Collective helpers: coalesced (flattened) versions of per-tensor collectives, and bytes
exchanged between ranks.

One collective on a flat buffer costs one round of latency; many small tensors sent one by one
cost one each. These helpers flatten tensors of one dtype and device into a buffer, run a single
collective on it, and copy the result back.

``all_gather_bytes`` and ``broadcast_bytes`` carry byte strings of any length (JSON a caller
made: nothing that arrives is unpickled): the length travels first, then the bytes, padded to
the longest on an all-gather, on the device the group's collectives use.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.distributed.groups import collective_device, global_rank


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


def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None) -> list[bytes]:
    """Every rank's ``data``, in group-rank order. Collective: two all-gathers over ``group``
    (the lengths, then the bytes padded to the longest)."""
    world = dist.get_world_size(group)
    device = collective_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = _as_tensor(data, device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [_as_bytes(t[: int(s.item())]) for t, s in zip(gathered, sizes)]


def broadcast_bytes(data: bytes | None, src: int, group: dist.ProcessGroup | None) -> bytes:
    """Group rank ``src``'s ``data`` on every rank (the others pass None). Collective: two
    broadcasts over ``group`` (the length, then the bytes)."""
    device = collective_device(group)
    root = global_rank(group, src)
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64,
                        device=device)
    dist.broadcast(size, root, group=group)
    buf = (_as_tensor(data, device) if data is not None
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, root, group=group)
    return _as_bytes(buf)


def _as_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()
