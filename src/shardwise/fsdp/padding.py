"""The flat-parameter layout as pure functions: padding, shard bounds, each parameter's local part.

A unit's parameters are laid out back to back in one flat buffer of ``total`` elements, padded
to a multiple of the world size so that every rank owns an equal, contiguous shard. Rank r owns
flat elements ``[r * shard, (r + 1) * shard)``. A parameter may fall entirely inside one rank's
shard, straddle several, or (for small parameters and large worlds) miss a rank's shard
altogether; ``local_slices`` says, per parameter, which part of it this rank owns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalSlice:
    """The part of one parameter that one rank owns.

    ``shard_offset``: where it starts in the rank's shard; ``param_offset``: where it starts in
    the flattened parameter; ``length``: how many elements (0 when the rank owns none of it).
    """

    shard_offset: int
    param_offset: int
    length: int


def padded_numel(total: int, world_size: int) -> int:
    """``total`` rounded up to a multiple of ``world_size`` (at least ``world_size``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if total < 0:
        raise ValueError(f"total must be non-negative, got {total}")
    return max(1, -(-total // world_size)) * world_size


def shard_numel(total: int, world_size: int) -> int:
    """Elements in each rank's shard of a flat buffer of ``total`` elements."""
    return padded_numel(total, world_size) // world_size


def shard_bounds(rank: int, total: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` in the padded flat buffer that ``rank`` owns."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    n = shard_numel(total, world_size)
    return rank * n, (rank + 1) * n


def flat_offsets(numels: Sequence[int]) -> list[int]:
    """Start of each parameter in the flat buffer (parameters back to back, no gaps)."""
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += n
    return offsets


def local_slices(numels: Sequence[int], rank: int, world_size: int) -> list[LocalSlice]:
    """For each parameter (of ``numels`` elements, laid out back to back), the part ``rank``
    owns. Lengths over all parameters sum to the shard size minus this rank's padding."""
    start, end = shard_bounds(rank, sum(numels), world_size)
    slices = []
    for offset, n in zip(flat_offsets(numels), numels):
        lo, hi = max(offset, start), min(offset + n, end)
        if hi <= lo:
            slices.append(LocalSlice(shard_offset=0, param_offset=0, length=0))
        else:
            slices.append(LocalSlice(shard_offset=lo - start, param_offset=lo - offset,
                                     length=hi - lo))
    return slices


def padding_of(rank: int, total: int, world_size: int) -> int:
    """Padding elements at the end of ``rank``'s shard (only the last ranks have any)."""
    start, end = shard_bounds(rank, total, world_size)
    return end - max(start, min(end, total))
