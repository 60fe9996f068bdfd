"""What the root unit coordinates for the whole tree of units: order, prefetch, end of backward.

[Note: FSDP schedule]
Forward: each unit's pre-forward issues its own all-gather (unless a prefetch already did), then
the all-gather of the unit that followed it in the previous forward (the forward order is
recorded every iteration), and only then waits for its own. So while one unit computes, the
next unit's parameters arrive on gloo's threads (or NCCL's stream). At most
``max_inflight_gathers`` all-gathers are outstanding. It is 1 unless the root was built with
``forward_prefetch=True`` (then 2): with 1, a unit's own gather takes the only place, so forward
gathers each unit when it is needed (the unsharded memory is the root and one unit, as in
torch's FSDP2 on CPU); with 2 the next unit's gather overlaps the current unit's compute, for
one unit more of memory (figures in docs/fsdp.md). (The peak is in backward, see below.)
The root, and the unit that ran last in forward, stay unsharded after forward: backward starts
with them.

Backward: units run in reverse forward order. A unit's pre-backward (a hook on its outputs'
gradients) waits for its parameters and prefetches the next unit in that reverse order, unless
``max_unsharded_units`` (default 2) non-root units are already unsharded, in which case the
prefetch is issued when the unit before it frees its parameters (its post-backward). Where a
unit's backward ends (once the gradients of its forward's inputs are computed: [Note: where a
unit's backward ends], unit.py) its reduce-scatter is issued and the unit reshards at once. A
reduction in flight is finished when the next unit's first gradient arrives, before that unit's
flat gradient is allocated, and in any case before another reduction is issued (at most
``max_inflight_reductions``, default 1, are outstanding). So it overlaps the next unit's
pre-backward and the computation of its first gradient, and no unit's flat gradient is
allocated while another unit's reduction still holds its own: the flat gradients alive are the
root's (whose head receives the first gradient of backward) and at most one other unit's.
With no per-parameter gradients kept next to the flat one, and a reduce-scatter that receives
straight into its output on two ranks (fast_collectives.py), no unit's gradients are alive twice
at the backward peak (what the peak holds: docs/fsdp.md). torch's FSDP2 on the CPU reduces
synchronously (its streams are no-ops there), so it has no reduction in flight, but it
copies each unit's gradients into a reduce-scatter input while they are alive.
A callback queued on autograd's engine ends the backward of the units that backward reached
but whose forward had no input requiring grad (the root among them), in the root's order, and
reduces their gradients; reduces any gradient that arrived after its unit's reduction ([Note:
FSDP unit states], unit.py) or in a unit that backward never reached; finishes the remaining
reductions and reshards whatever is still unsharded when the backward pass ends.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardwise._compat import backward_running
from shardwise.fsdp.collectives import StoragePool, host_barrier, queue_end_of_backward
from shardwise.fsdp.flat_param import GradReduction, ShardState
from shardwise.fsdp.reduction import drop_unused_grads

if TYPE_CHECKING:
    from shardwise.fsdp.unit import FSDPUnit


class RootState:
    """Shared by every unit under one root; see [Note: FSDP schedule]."""

    def __init__(self, units: list[FSDPUnit], max_inflight_gathers: int = 1,
                 max_inflight_reductions: int = 1, max_unsharded_units: int = 2):
        self.units = units  # root first
        self.max_inflight_gathers = max_inflight_gathers
        self.max_inflight_reductions = max_inflight_reductions
        self.max_unsharded_units = max_unsharded_units  # in backward, the root not counted
        self.forward_order: list[FSDPUnit] = []  # this iteration's pre-forward calls
        self.previous_order: list[FSDPUnit] = []
        self.reductions: deque[tuple[FSDPUnit, GradReduction]] = deque()
        self.callback_queued = False
        self.building_graph = False  # this backward runs with create_graph=True: see unit.py
        self._order_cache: tuple | None = None  # ((id, len) of forward_order, order, positions)
        # unsharded buffers passed from unit to unit: [Note: unshard buffer pool]
        self.storage_pool = StoragePool()

    # ---- forward ------------------------------------------------------------------------
    def start_forward(self) -> None:
        """Called by the root's pre-forward: a new iteration's order starts."""
        if self.forward_order:
            self.previous_order = self.forward_order
        self.forward_order = []

    def unshard_for_forward(self, unit: FSDPUnit,
                            explicit: list[FSDPUnit] | None = None) -> None:
        """Issue ``unit``'s all-gather, prefetch the next unit's (or the ``explicit`` units',
        set by ``set_modules_to_forward_prefetch``), then wait for ``unit``'s."""
        k = len(self.forward_order)
        self.forward_order.append(unit)
        unit.forward_index = k
        if unit.handle is not None:
            unit.handle.start_unshard()
        prev = self.previous_order
        if explicit is not None:
            for other in explicit:
                if other.handle is not None:
                    other.handle.start_unshard()
        elif k + 1 < len(prev) and prev[k] is unit:
            self._prefetch(prev[k + 1])
        if unit.handle is not None:
            unit.handle.finish_unshard()

    def runs_last(self, unit: FSDPUnit) -> bool:
        """Whether ``unit``'s current forward call was the last unit call of the previous
        forward: backward needs its parameters first, so resharding them would only mean
        gathering them again at once."""
        prev = self.previous_order
        return bool(prev) and unit.forward_index == len(prev) - 1 and prev[-1] is unit

    def _prefetch(self, unit: FSDPUnit) -> None:
        handle = unit.handle
        if handle is None or handle.state is not ShardState.SHARDED:
            return
        if self._gathers_in_flight() < self.max_inflight_gathers:
            handle.start_unshard()

    def _gathers_in_flight(self) -> int:
        return sum(1 for u in self.units
                   if u.handle is not None and u.handle.state is ShardState.GATHERING)

    # ---- backward -----------------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        """A backward pass through the tree is running (from its first pre-backward hook to
        the end-of-backward callback)."""
        return self.callback_queued

    def enter_backward(self) -> bool:
        """Every unit's pre-backward: on the first of a backward pass, queue the end-of-backward
        callback and return True."""
        if self.callback_queued:
            return False
        self.callback_queued = True
        self.building_graph = torch.is_grad_enabled()  # [Note: backward with create_graph]
        queue_end_of_backward(self.end_of_backward)
        return True

    def prefetch_for_backward(self, unit: FSDPUnit) -> None:
        """Prefetch the first unit after ``unit`` in backward order (reverse forward order)
        that is still sharded and still needs its backward, unless ``max_unsharded_units``
        non-root units are already gathered or gathering. Called from a unit's pre-backward and
        again from its post-backward (when it has just freed its parameters)."""
        order, position = self._backward_order()
        if unit not in position or self._unsharded_units() >= self.max_unsharded_units:
            return
        for nxt in order[position[unit] + 1 :]:
            if nxt.backward_done or not nxt.needs_gradients():
                continue
            if nxt.handle.state is ShardState.SHARDED:
                self._prefetch(nxt)
                return

    def _backward_order(self) -> tuple[list[FSDPUnit], dict[FSDPUnit, int]]:
        """The units in reverse forward order (each once) and their positions in it, made once
        per backward pass (the forward order does not change during backward)."""
        key = (id(self.forward_order), len(self.forward_order))  # recompute may append
        if self._order_cache is None or self._order_cache[0] != key:
            order = list(dict.fromkeys(reversed(self.forward_order)))
            self._order_cache = (key, order, {u: i for i, u in enumerate(order)})
        return self._order_cache[1], self._order_cache[2]

    def _unsharded_units(self) -> int:
        return sum(1 for u in self.units if not u.is_root and u.handle is not None
                   and u.handle.state is not ShardState.SHARDED)

    def make_room_for_reduction(self) -> None:
        """Finish the oldest reductions until a new one fits under the cap (their buffers are
        freed before the new one allocates its own)."""
        while len(self.reductions) >= self.max_inflight_reductions:
            self._finish_oldest_reduction()

    def add_reduction(self, unit: FSDPUnit, reduction: GradReduction) -> None:
        self.reductions.append((unit, reduction))

    def finish_reductions(self) -> None:
        """Finish every reduction in flight (called when a unit's first gradient arrives)."""
        while self.reductions:
            self._finish_oldest_reduction()

    def _finish_oldest_reduction(self) -> None:
        unit, reduction = self.reductions.popleft()
        unit.handle.finish_grad_reduction(reduction)

    def end_of_backward(self) -> None:
        """End the backward of the units still in it (their reductions, in the root's order),
        reduce late gradients, finish every reduction, reshard every unit, reset per-backward
        state (see [Note: FSDP schedule])."""
        for unit in self.units:
            if unit.reached_by_backward():  # every rank ends its backward here
                unit.end_backward_at_callback()
            elif unit.late_grads or (not unit.backward_done and unit.grads_arrived()):
                unit.reduce_gradient()
        self.finish_reductions()
        # [Note: gradients of unused parameters]; its all-reduces are barriers too
        synced = drop_unused_grads(self.units)
        self.sync_host(skip=synced)  # every rank's backward has read the peers' rows
        self._reset_units(reshard_all=False)

    def _reset_units(self, reshard_all: bool) -> None:
        """Reshard every unit (``reshard_all``) or those that reshard after backward, make each
        ready for the next backward, and clear this backward's state."""
        for unit in self.units:
            if unit.handle is not None:
                if reshard_all or unit.reshards_after_backward():
                    unit.handle.reshard()
                unit.handle.new_backward()
            unit.end_backward()
        self.storage_pool.clear()  # [Note: unshard buffer pool]: not held past backward
        self.callback_queued = self.building_graph = False

    # ---- a backward that raised ---------------------------------------------------------
    # [Note: a backward that raised]
    # Autograd runs no queued callback for a backward pass that raised (a hook, a check, an
    # out-of-memory error), so ``end_of_backward`` never runs for it: units stay in PRE_BACKWARD,
    # reductions stay in flight, and ``callback_queued`` stays set. The next forward would then look
    # like an activation-checkpoint recompute, and the next backward would queue no callback (its
    # gradients never reach ``.grad``); a state dict taken in the exception handler would hold the
    # parameters that backward left gathered, not the shards. So every unit's pre-forward,
    # ``state_dict`` and ``summon_full_params`` first ask whether the callback is still due while
    # autograd's engine runs no backward on this thread; if so, that backward raised, and
    # ``abandon_backward`` ends it: it waits for the exchanges already posted (every rank posted the
    # same ones when every rank raised at the same point, so the group's channels stay paired; it
    # posts none, so one rank may do this alone) and drops what they reduce, drops the gradients not
    # yet sent, reshards, and resets every unit. Gradients that reached ``.grad`` before the error
    # stay there, as plain torch leaves a failed backward's gradients; the rest are dropped, since
    # the next forward usually comes after the user's ``zero_grad`` and would otherwise put them in
    # the next step's gradients; it warns that it did. A rank that raised alone leaves its peers
    # waiting in their backward for its messages; they fail at the group's timeout.
    # tests/fsdp/test_failed_backward.py.
    def end_abandoned_backward(self) -> None:
        """End the last backward if it raised ([Note: a backward that raised]); called before a
        unit's forward, a state dict and ``summon_full_params``."""
        if self.callback_queued and not backward_running():
            self.abandon_backward()

    def abandon_backward(self) -> None:
        """Wait for the communication the raised backward issued, drop its unreduced
        gradients, reshard and reset every unit; warn. Issues no collective."""
        warnings.warn("FSDP: the previous backward pass raised before it ended; the gradients "
                      "it had not reduced into .grad yet are dropped", stacklevel=4)
        while self.reductions:  # the messages must land before their buffers go
            self.reductions.popleft()[1].pending.wait_posted()
        for unit in self.units:
            if unit.handle is not None:
                unit.handle.drop_gradients()
        self._reset_units(reshard_all=True)  # no collective: one rank may be alone here

    # ---- parameters shared on the host ---------------------------------------------------
    def sync_host(self, skip: Iterable[int] = ()) -> None:
        """A barrier over each group whose units hold their parameters in one mapping per host
        ([Note: parameters shared on one host], host_params.py): issued before and after the
        root's forward and at the end of backward, so that no rank writes its rows while a peer
        reads them. Nothing where no unit shares, nor over the groups in ``skip`` (ids of
        groups whose ranks have just met in another collective)."""
        seen: set[int] = set(skip)
        for unit in self.units:
            handle = unit.handle
            if handle is not None and handle.host is not None and id(handle.group) not in seen:
                seen.add(id(handle.group))
                host_barrier(handle.group)

    # ---- measurement --------------------------------------------------------------------
    def unsharded_bytes(self) -> int:
        """Bytes of full (unsharded) parameter buffers alive right now over all units."""
        return sum(u.handle.unsharded_bytes() for u in self.units if u.handle is not None)

    def reduction_bytes(self) -> int:
        """Bytes of flat gradients that reduce-scatters in flight still hold."""
        return sum(r.held_bytes() for _, r in self.reductions)
