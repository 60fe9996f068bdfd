"""Which rank owns which parameter, and how owned parameters are cut into broadcast chunks.

Pure functions over sizes, no processes and no tensors: every rank computes the same answer
from the same parameter shapes, so no collective is needed to agree on a partition.

[Note: ZeRO partition]
ZeRO stages 1 and 2 shard whole parameters (not slices of them): each parameter is owned by one
rank, whose local optimizer alone keeps its state and updates it. Ownership is decided greedily,
largest parameter first, each going to the rank that holds the least so far (ties: the lowest
rank). A parameter's weight is the pair (trainable bytes, frozen bytes), compared in that order:
trainable parameters are balanced by their bytes first, since only they get optimizer state and
are broadcast after a step; frozen parameters (no state, never broadcast) come after them and
are spread by their own bytes among the ranks that hold the least trainable bytes. When every
parameter is trainable and of one dtype this is torch's partition (sorted greedy by numel());
torch also counts frozen parameters, which can leave the ranks' optimizer state unbalanced
when a model has a large frozen part. Param groups are walked in order and loads carry over
from one group to the next, so the balance is over the whole model, and a group added later
(``add_param_group``) never moves a parameter of an earlier group. The greedy bound: no rank
holds more than ``total / world_size + largest parameter`` trainable bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# partition[rank][group] -> indices (within the group, ascending) of the parameters rank owns
Partition = list[list[list[int]]]
# (trainable bytes, frozen bytes) of a parameter or a rank; a plain int means trainable bytes
Weight = tuple[int, int]


def weight(size: int | Sequence[int]) -> Weight:
    """``size`` as a (trainable bytes, frozen bytes) pair; an int is all trainable."""
    if isinstance(size, int):
        return (size, 0)
    trainable, frozen = size
    return (int(trainable), int(frozen))


def partition_params(group_sizes: Sequence[Sequence[int | Weight]], world_size: int,
                     loads: Sequence[int | Weight] | None = None) -> Partition:
    """Assign every parameter (given as its weight, per param group) to one rank.

    ``loads`` are the weights each rank already holds (from earlier groups); default zeros.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    load = [weight(x) for x in loads] if loads is not None else [(0, 0)] * world_size
    if len(load) != world_size:
        raise ValueError(f"loads has {len(load)} entries for world size {world_size}")
    result: Partition = [[[] for _ in group_sizes] for _ in range(world_size)]
    # the ranks by (load, rank): the least loaded, lowest rank first, in O(log N) per parameter
    heap = [(w, rank) for rank, w in enumerate(load)]
    heapq.heapify(heap)
    for g, group in enumerate(group_sizes):
        sizes = [weight(x) for x in group]
        for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k][0], -sizes[k][1], k)):
            if min(sizes[i]) < 0:
                raise ValueError(f"parameter {i} of group {g} has negative size {sizes[i]}")
            w, rank = heap[0]
            result[rank][g].append(i)
            heapq.heapreplace(heap, (_add(w, sizes[i]), rank))
    for per_rank in result:
        for indices in per_rank:
            indices.sort()
    return result


def _add(a: Weight, b: Weight) -> Weight:
    return (a[0] + b[0], a[1] + b[1])


def rank_loads(partition: Partition, group_sizes: Sequence[Sequence[int | Weight]]
               ) -> list[Weight]:
    """The (trainable bytes, frozen bytes) each rank owns under ``partition``."""
    loads = []
    for per_rank in partition:
        total = (0, 0)
        for g, idx in enumerate(per_rank):
            for i in idx:
                total = _add(total, weight(group_sizes[g][i]))
        loads.append(total)
    return loads


def owners(partition: Partition) -> dict[tuple[int, int], int]:
    """(group, index within group) -> owning rank."""
    return {(g, i): rank for rank, per_rank in enumerate(partition)
            for g, idx in enumerate(per_rank) for i in idx}


def global_indices(group_lengths: Sequence[int]) -> list[list[int]]:
    """The index a plain optimizer's ``state_dict`` gives each parameter: consecutive over the
    param groups in order. ``result[g][i]`` is the global index of group g's i-th parameter."""
    out, start = [], 0
    for n in group_lengths:
        out.append(list(range(start, start + n)))
        start += n
    return out


def chunk_by_bytes(sizes: Sequence[int], cap_bytes: int) -> list[list[int]]:
    """Split positions ``0..len(sizes)-1`` into consecutive runs of at most ``cap_bytes`` each
    (a single item larger than the cap gets a run of its own). Empty input: no runs."""
    if cap_bytes <= 0:
        raise ValueError(f"chunk cap must be positive, got {cap_bytes} bytes")
    runs: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not runs or used + size > cap_bytes:
            runs.append([])
            used = 0
        runs[-1].append(i)
        used += size
    return runs
