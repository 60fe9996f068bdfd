"""Which of a unit's parameter gradients have arrived: on this rank (the one record of it), and
on any rank at the end of backward (parameters no rank used keep ``grad is None``).

[Note: gradient arrival]
One ``GradArrivals`` per unit, owned by its reduction path (reduction.py), answers the
questions a gradient raises:
- for the unit's state machine ([Note: FSDP unit states]): did any gradient arrive in this
  backward? (Where the unit's backward ends does not depend on which gradients arrived: [Note:
  where a unit's backward ends], unit.py.)
- for the handle's gradient buffers ([Note: flat parameters], [Note: direct gradient
  reduction]): is a parameter's gradient already in the buffers waiting to be reduced (a second
  one is added, a first one copied), and which never arrived (their chunks are sent as zeros)?
Both come from one map, slot index -> the backward in which that slot's gradient last arrived,
holding the gradients not yet handed to a reduction. Handing them over (``taken``) empties the
map; a new backward (``new_backward``) keeps it, since gradients accumulated without sync
(``no_sync``) stay in the buffers until a backward reduces them.

[Note: gradients of unused parameters]
Every rank reduces every parameter of a unit whose backward ended, with zeros for those it got
no gradient for ([Note: where a unit's backward ends], unit.py): the ranks' messages must pair
up although a branch or an expert ran on some ranks only. A parameter that no rank used (a
pooler that the loss never reaches, a head that is only used for evaluation) would so get a
zero gradient where plain torch and torch's FSDP2 leave ``None``, and the optimizer would not
skip it: AdamW decays its weights and moves it with its old moments, so training drifts away
from the one-process run. So at the end of backward, after every reduction has finished, the
ranks agree on which parameters any of them had a gradient for: one all-reduce (MAX) per group
of a flag per parameter (and across the replicas of hybrid sharding), and a ``.grad`` that this
backward's reductions created for a parameter no rank used is set back to ``None``. A
gradient that existed before the backward (accumulated over steps) keeps its values, which
adding zeros did not change. The all-reduce also serves as the end-of-backward barrier of a
group whose parameters are shared on one host ([Note: parameters shared on one host]), which
then issues no barrier of its own. On a GPU the flags are read on the host, so the end of each
backward waits for the device once (as DDP's ``find_unused_parameters=True`` does). Units under
``set_reduce_scatter_unused_params(True)`` keep their zero gradients, as torch's FSDP2 does with
that setting, and join no agreement (nor wait); units with gradient sync off reduce nothing and
join none. tests/fsdp/test_fsdp_unused_params.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwise.fsdp.collectives import max_over

if TYPE_CHECKING:
    from shardwise.fsdp.unit import FSDPUnit


class GradArrivals:
    """Arrival of each slot's gradient; see [Note: gradient arrival]."""

    def __init__(self) -> None:
        self._pending: dict[int, int] = {}  # slot index -> backward of its last arrival
        self._backward = 0  # counts backward passes
        self._count = 0  # slots in `_pending` that arrived in this backward

    def record(self, index: int) -> bool:
        """Slot ``index``'s gradient arrived. Returns whether a gradient of this slot is already
        waiting (add to it, not copy)."""
        last = self._pending.get(index)
        if last != self._backward:
            self._count += 1
            self._pending[index] = self._backward
        return last is not None

    def any_now(self) -> bool:
        """Whether a gradient arrived in this backward (and was not handed over since)."""
        return self._count > 0

    def waiting(self, index: int) -> bool:
        """Whether slot ``index``'s gradient is in the buffers, waiting to be reduced."""
        return index in self._pending

    def taken(self) -> None:
        """The waiting gradients were handed to a reduction."""
        self._pending.clear()
        self._count = 0

    def new_backward(self) -> None:
        """A new backward pass: nothing has arrived in it yet."""
        self._backward += 1
        self._count = 0


class ReducedSlots:
    """One handle's record of this backward's reductions: which slots this rank contributed a
    gradient to, and which slots' ``.grad`` the reductions created."""

    def __init__(self, count: int):
        self.count = count
        self.used = [False] * count  # a gradient of the slot arrived here and was reduced
        self.made: list[int] = []  # slots whose .grad a reduction of this backward created

    def reduced(self, arrived: Sequence[bool]) -> None:
        """A reduction was issued; ``arrived[i]``: slot i's gradient was in it on this rank."""
        self.used = [u or a for u, a in zip(self.used, arrived, strict=True)]

    def grad_made(self, index: int) -> None:
        self.made.append(index)

    def clear(self) -> None:
        self.used = [False] * self.count
        self.made = []


def _joins(unit: FSDPUnit) -> bool:
    """Whether ``unit`` takes part in the agreement: the same answer on every rank, as it
    depends only on the unit's settings."""
    return (unit.handle is not None and unit.handle.requires_grad and not unit.no_sync
            and not unit.reduce_scatter_unused_params)


def drop_unused_grads(units: Sequence[FSDPUnit]) -> set[int]:
    """Agree over each unit's group (and replicas) on the parameters no rank had a gradient
    for in this backward, and set the ``.grad`` its reductions made for them back to None. One
    all-reduce per group; returns the ids of the groups it ran over (each was a barrier)."""
    by_group: dict[tuple[int, int], list[FSDPUnit]] = {}
    for unit in units:
        if _joins(unit):
            key = (id(unit.handle.group), id(unit.handle.replicate_group))
            by_group.setdefault(key, []).append(unit)
    synced: set[int] = set()
    for members in by_group.values():
        handle = members[0].handle
        flags = torch.tensor([int(u) for m in members for u in m.handle.reduced.used],
                             dtype=torch.int32, device=handle.compute_device)
        synced |= max_over(flags, (handle.group, handle.replicate_group))
        if dist.get_backend(handle.group) == "fake":  # a dry run's flags carry no values
            continue
        used = flags.tolist()
        for member in members:
            count = member.handle.reduced.count
            member.handle.drop_grads_of_unused(used[:count])
            used = used[count:]
    return synced
