"""Facts about a process group that every mechanism asks: its ranks in the world, and the
device its collectives run on. No collective is issued here."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The world rank of ``rank`` in ``group`` (``None``: the world, unchanged)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The world rank of every rank of ``group``, in group-rank order."""
    return [global_rank(group, r) for r in range(dist.get_world_size(group))]


def rank_table(group: dist.ProcessGroup | None) -> Sequence[int]:
    """``global_ranks(group)`` held compactly: a ``range`` when the ranks are evenly spaced
    (the world, and every group of a mesh dimension), so that a structure keeping it per unit
    costs the same at any world size; a list otherwise. Read once from c10d's table of the
    group (``get_global_rank`` per rank would scan that table once per rank)."""
    if group is None or group is dist.group.WORLD:
        return range(dist.get_world_size())
    ranks = dist.get_process_group_ranks(group)
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    evenly = step > 0 and all(r == ranks[0] + i * step for i, r in enumerate(ranks))
    return range(ranks[0], ranks[0] + len(ranks) * step, step) if evenly else ranks


def backend_device(backend: str) -> torch.device:
    """The device a collective of ``backend`` takes its tensors on: NCCL's the current CUDA
    device, every other backend's the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s collectives take their tensors on (default group: None)."""
    return backend_device(dist.get_backend(group))


def group_alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still a registered process group (not destroyed, by
    ``destroy_process_group(group)`` or with the default group)."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return False
    return True
