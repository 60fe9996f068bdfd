"""The element-wise ZeRO partition: parameters concatenated and cut into equal ranges.

[Note: ZeRO element partition]
With ``partition="elements"`` (ZeroRedundancyOptimizer, and so ZeroDataParallel) the trainable
parameters of one dtype are laid out back to back, in param-group order and within a group in
the group's order, as one flat *segment* of ``total`` elements, padded to ``world * chunk``
with ``chunk = ceil(total / world)``. Rank r owns the elements ``[r * chunk, (r + 1) * chunk)``
of each segment (clipped to ``total``): a parameter may be split across ranks, and every rank
holds the optimizer state (and, under stage 2, the gradients) of at most ``chunk`` elements per
dtype, ``total / world`` plus less than one element, whatever the shapes. This is DeepSpeed's
ZeRO partition; the whole-parameter one (partition.py) stays the default for torch's
semantics. The optimizer updates a rank's range through *pieces*: one 1-D view per parameter
that overlaps the range, into the parameter's own storage, so stepping a piece updates the
parameter in place. Only an optimizer whose update of an element reads that element's gradient
and state alone (plus scalars such as the step count) gives the same result stepped piece by
piece: such classes are listed in ``ELEMENT_WISE`` (or set ``element_wise = True``).

Pure functions over sizes, like partition.py: every rank computes the same layout, with no
collective.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# optimizers whose update of each element reads only that element's gradient and state and
# scalars (lr, step count): stepping any slices of the parameters equals stepping them whole
ELEMENT_WISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                torch.optim.Adadelta)
PARTITIONS = ("parameters", "elements")


def check_partition(partition: object) -> str:
    """``partition`` if it is a known spelling; a clear error otherwise."""
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {', '.join(map(repr, PARTITIONS))}, got "
                         f"{partition!r}")
    return partition  # type: ignore[return-value]


def is_element_wise(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` may step a parameter piece by piece (see the note)."""
    return optimizer_class in ELEMENT_WISE or getattr(optimizer_class, "element_wise", False)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of parameter ``index`` of param group ``group`` (flattened),
    at ``offset`` in its segment."""

    group: int
    index: int
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class Segment:
    """One dtype's trainable parameters laid out flat and cut into ``world`` equal ranges.

    ``members`` are ``(group, index, numel)`` in layout order."""

    def __init__(self, members: Sequence[tuple[int, int, int]], world: int):
        if world < 1:
            raise ValueError(f"world_size must be at least 1, got {world}")
        self.members = list(members)
        self.world = world
        self.offsets: list[int] = []
        total = 0
        for _, _, numel in self.members:
            self.offsets.append(total)
            total += numel
        self.total = total
        self.chunk = -(-total // world)

    def range_of(self, rank: int) -> tuple[int, int]:
        """The elements of the segment ``rank`` owns."""
        return min(rank * self.chunk, self.total), min((rank + 1) * self.chunk, self.total)

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of parameters in ``rank``'s range, in layout order."""
        lo, hi = self.range_of(rank)
        out = []
        first = max(bisect.bisect_right(self.offsets, lo) - 1, 0)
        for k in range(first, len(self.members)):
            group, index, numel = self.members[k]
            start = self.offsets[k]
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, start + numel)
            if b > a:
                out.append(Piece(group, index, a - start, b - start, a))
        return out


def segments_of(groups: Sequence[Sequence[torch.Tensor]], world: int
                ) -> dict[torch.dtype, Segment]:
    """The segments of the trainable parameters of ``groups``, one per dtype (first-seen
    order); frozen parameters are in none (no rank steps them)."""
    members: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    for g, params in enumerate(groups):
        for i, p in enumerate(params):
            if p.requires_grad:
                members.setdefault(p.dtype, []).append((g, i, p.numel()))
    return {dtype: Segment(m, world) for dtype, m in members.items()}


def bucket_parts(offsets: Sequence[int], numels: Sequence[int], segment: Segment
                 ) -> list[tuple[int, int]]:
    """Per rank, the (start, end) elements of a gradient bucket holding its range of
    ``segment``, for a bucket of parameters at segment ``offsets`` (ascending) packed back to
    back with ``numels`` elements each. A rank's range is one interval of the segment and the
    bucket keeps segment order, so what a rank owns of the bucket is contiguous in it."""
    packed = [0]
    for n in numels:
        packed.append(packed[-1] + n)

    def local(x: int) -> int:  # the bucket elements whose segment position is below x
        k = bisect.bisect_right(offsets, x) - 1
        if k < 0:
            return 0
        return packed[k] + min(x - offsets[k], numels[k])

    parts = [(0, 0)] * segment.world
    if not numels or segment.chunk == 0:
        return parts
    # only the ranks whose ranges meet the bucket's span have a part: O(those) per bucket
    first = offsets[0] // segment.chunk
    last = (offsets[-1] + numels[-1] - 1) // segment.chunk
    for rank in range(first, min(last, segment.world - 1) + 1):
        lo, hi = segment.range_of(rank)
        start, end = local(lo), local(hi)
        if end > start:
            parts[rank] = (start, end)
    return parts
