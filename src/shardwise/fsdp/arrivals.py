"""Which of a unit's parameter gradients have arrived: the one record of it.

[Note: gradient arrival]
One ``GradArrivals`` per flat-parameter handle answers the questions a gradient raises:
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
"""

from __future__ import annotations


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
