"""Where ZeRO stage 2 fills each gradient bucket on one host: its region of a shared ring.

[Note: stage 2 shared-memory ring]
On one host a bucket is filled straight into this rank's shared-memory slot, which the peers
read their parts from (``ShmReducer.launch_scatter``, [Note: same-host shared-memory
reduction] in dp/shm_reduce.py). The slot is one ring of ``capacity`` elements, and each bucket
has a fixed region of it: the buckets are packed in launch order, each starting where the
previous one ends (at a 64-byte boundary), and a bucket that would pass the end starts again at
0. Where all buckets fit (``capacity`` at least their total), every bucket has a region of its
own; otherwise later buckets reuse the regions of earlier ones. Regions, not slots of the
largest bucket's size, so that the small buckets at the end of backward take only their own
bytes and many of them are in flight at once: a bucket that finds its region busy is filled in
private memory and copied over at launch, after this rank has waited for the peers to read the
region's last bucket.

A bucket may fill its region now when

1. no other bucket fills into the same bytes (one whose region overlaps and that holds it),
2. no bucket that is launched before it and overlaps it is still to be filled in this
   backward pass (it would need these bytes first; gradients may arrive in any order), and
3. every rank has read what was last posted in the overlapping regions, its own included: the
   ranks' reads go in posting order, so that is one comparison of sequence numbers.

Rule 2 makes the wait at launch safe: a bucket filled privately waits only for reads of
buckets already posted (the earlier ones of this pass, the later ones of the last pass), never
for a bucket still to be launched. The plan depends on the buckets' sizes alone, so it is the
same on every rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from shardwise.dp.buckets import Bucket, BucketState

ALIGN_BYTES = 64


def plan_regions(numels: Sequence[int], capacity: int, align: int = 1) -> list[int]:
    """Start of each bucket's region (elements): packed in order, each at a multiple of
    ``align``, wrapping to 0 where a bucket would pass ``capacity``."""
    if numels and max(numels) > capacity:
        raise ValueError(f"a bucket of {max(numels)} elements does not fit a ring of "
                         f"{capacity}")
    starts, at = [], 0
    for numel in numels:
        at = -(-at // align) * align
        if at + numel > capacity:
            at = 0
        starts.append(at)
        at += numel
    return starts


def ring_capacity(numels: Sequence[int], largest: float, align: int = 1) -> int:
    """Elements of a ring that gives every bucket a region of its own, or of ``largest`` times
    the largest bucket where that is smaller (at least ``largest`` = 1: one bucket)."""
    if largest < 1:
        raise ValueError(f"the ring must hold the largest bucket, got {largest} times it")
    end = plan_regions(numels, sys.maxsize, align)[-1] + numels[-1]  # packed, never wrapping
    return min(end, int(largest * max(numels)))


class RegionRing:
    """Each bucket's region of the ring and whether it may be filled now (see the Note)."""

    def __init__(self, buckets: Sequence[Bucket], capacity: int, align: int = 1):
        self.buckets = list(buckets)
        self.capacity = capacity
        self.starts = plan_regions([b.numel for b in self.buckets], capacity, align)
        spans = [(s, s + b.numel) for s, b in zip(self.starts, self.buckets)]
        self.overlaps = [[j for j, (s2, e2) in enumerate(spans) if j != i and s < e2 and s2 < e]
                         for i, (s, e) in enumerate(spans)]
        self.last_seq = [0] * len(self.buckets)  # per bucket, the sequence number last posted
        self.private_fills = 0  # buckets filled in private memory (their region was busy)

    def region(self, index: int) -> tuple[int, int]:
        start = self.starts[index]
        return start, start + self.buckets[index].numel

    def last_posted(self, index: int) -> int:
        """The newest posting that bucket ``index``'s region still holds for the peers."""
        return max([self.last_seq[index], *(self.last_seq[j] for j in self.overlaps[index])])

    def may_fill(self, index: int, holds: Callable[[int], bool],
                 read_through: Callable[[int], bool]) -> bool:
        """Whether bucket ``index`` may be filled in its region now: rules 1-3 of the Note.
        ``holds(j)``: bucket j is filling its region; ``read_through(seq)``: every rank has
        read every posting up to ``seq``."""
        busy = any(self.buckets[j].state is BucketState.FILLING and (j < index or holds(j))
                   for j in self.overlaps[index])
        if not busy and read_through(self.last_posted(index)):
            return True
        self.private_fills += 1
        return False
