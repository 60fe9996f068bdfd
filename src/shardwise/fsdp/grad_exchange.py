"""A unit's gradient reduce-scatter sent straight from autograd's gradients (gloo on CPU).

[Note: direct gradient reduction]
The reduce-scatter of [Note: flat parameters] first copies every gradient into a rank-major flat
buffer: one pass over the whole model's gradients per step, on the compute thread, before a byte
moves. On gloo our reduce-scatter is point-to-point anyway ([Note: fast collectives]), and the
rows of a parameter that rank r owns are contiguous in its gradient (``Shard(0)``, see
[Note: FSDP layout]). So the large ("direct") parameters skip the buffer. Their gradients are
held as autograd made them until the unit's last one is in; then, parameter by parameter in
layout order, each rank sends every other rank r the rows r owns, straight out of the gradient,
and receives the other ranks' copies of its own rows: the lowest other rank's into the reduced
shard itself, any further ones into a workspace. Waiting adds this rank's own rows and the
further copies (the same order as ``reduce_scatter_flat``) and divides by the world size. The
small ("packed") parameters still go through a rank-major buffer, only as large as the packed
region, and one ``reduce_scatter_flat``, as the gather packs them too.

Every rank issues the same messages in the same order, as for any collective: one exchange per
direct parameter and reduction (a gradient that never arrived on this rank is sent as zeros),
issued when the unit's gradients are complete, in the order units complete, which the buffered
path relies on already. The held gradients take the place of the flat buffer, which was as
large, and are let go when the sends have completed.

Taken only where it is exact and simple: gloo on CPU, more than one rank, no communication hook,
gradient sync on, and no gradient left over from a backward without sync (those accumulate in
the flat buffer, which then reduces everything).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.dp.fast_collectives import Pending, reduce_scatter_flat
from shardwise.fsdp.layout import UnitLayout, chunks_of, copy_into_chunks


class DirectGrads:
    """The gradients of one unit's reduction in direct mode, until it is issued."""

    def __init__(self, layout: UnitLayout, rank: int, global_ranks: Sequence[int],
                 group: dist.ProcessGroup, reduce_dtype: torch.dtype, device: torch.device):
        self.layout, self.rank, self.world = layout, rank, len(global_ranks)
        self.global_ranks, self.group = global_ranks, group
        self.reduce_dtype, self.device = reduce_dtype, device
        self.grads: dict[int, torch.Tensor] = {}  # direct parameter index -> whole gradient
        self.packed: torch.Tensor | None = None  # (world, packed_numel), rank-major

    def add(self, index: int, grad: torch.Tensor, accumulate: bool) -> None:
        """Take parameter ``index``'s whole gradient, or add it to the one taken before
        (``accumulate``: the handle's record, [Note: gradient arrival])."""
        param = self.layout.params[index]
        if param.packed:
            self._add_packed(index, grad, accumulate)
        elif accumulate:
            self.grads[index] = self.grads[index] + grad.to(self.reduce_dtype)
        else:
            self.grads[index] = grad.to(self.reduce_dtype)

    def _add_packed(self, index: int, grad: torch.Tensor, accumulate: bool) -> None:
        layout = self.layout
        if self.packed is None:
            self.packed = torch.empty(self.world, layout.packed_numel, dtype=self.reduce_dtype,
                                      device=self.device)
        param = layout.params[index]
        start = param.shard_offset - layout.packed_offset
        copy_into_chunks(self.packed[:, start : start + param.chunk_numel], grad, param,
                         accumulate=accumulate)

    def held_bytes(self) -> int:
        held = sum(g.untyped_storage().nbytes() for g in self.grads.values())
        return held + (0 if self.packed is None else self.packed.untyped_storage().nbytes())

    def start(self, arrived: Callable[[int], bool]
              ) -> tuple[Pending, torch.Tensor, list[torch.Tensor]]:
        """Issue every exchange: ``(pending, out, held)``. ``out`` (1D, ``shard_numel``) holds
        this rank's averaged shard once ``pending`` is waited for; ``held`` must stay alive
        until then (the tensors being sent). ``arrived(index)``: whether that parameter's
        gradient was added (the others are sent as zeros)."""
        layout = self.layout
        out = torch.empty(layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
        works, sums, held = [], [], []
        for index, param in layout.direct():
            grad = self.grads.get(index)
            if grad is None:  # never arrived here: this rank contributes zeros
                grad = torch.zeros(param.shape, dtype=self.reduce_dtype, device=self.device)
            flat = grad.reshape(-1)
            held.append(flat)
            own = self._exchange(flat, param, out, works, held)
            if own is not None:
                sums.append(own)
        packed_work = self._start_packed(out, arrived)
        if packed_work is not None:
            works.append(packed_work)
        self.grads = {}
        world, direct_end = self.world, layout.packed_offset

        def finish() -> None:
            for dest, pieces in sums:
                for piece in pieces:
                    dest.add_(piece)
            out[:direct_end].div_(world)

        return Pending(works, finish), out, held

    def _exchange(self, flat: torch.Tensor, param, out: torch.Tensor, works: list,
                  held: list) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Post one parameter's sends and receives; ``(dest, pieces to add)`` for its rows."""
        chunks = dict(chunks_of(flat, param))
        for r, rows in chunks.items():
            if r != self.rank:
                works.append(dist.isend(rows, self.global_ranks[r], group=self.group))
        own = chunks.get(self.rank)
        if own is None:
            return None
        dest = out[param.shard_offset : param.shard_offset + own.numel()]
        others = [r for r in range(self.world) if r != self.rank]
        pieces = [own]
        for k, r in enumerate(others):
            buf = dest if k == 0 else torch.empty_like(own)
            if k:
                held.append(buf)
                pieces.append(buf)
            works.append(dist.irecv(buf, self.global_ranks[r], group=self.group))
        return dest, pieces

    def _start_packed(self, out: torch.Tensor, arrived: Callable[[int], bool]):
        layout = self.layout
        if not layout.packed_numel:
            return None
        if self.packed is None:  # no small gradient arrived here: contribute zeros
            self.packed = torch.zeros(self.world, layout.packed_numel, dtype=self.reduce_dtype,
                                      device=self.device)
        for index, param in layout.packed():
            if not arrived(index):
                start = param.shard_offset - layout.packed_offset
                self.packed[:, start : start + param.chunk_numel].zero_()
        packed, self.packed = self.packed, None
        pending = reduce_scatter_flat(out[layout.packed_offset :], packed.view(-1), self.group,
                                      average=True, async_op=True)
        return _KeepAlive(pending, packed)


class _KeepAlive:
    """A ``Pending`` used as a work item, holding the buffer it sends from."""

    def __init__(self, pending: Pending, buffer: torch.Tensor):
        self.pending, self.buffer = pending, buffer

    def wait(self) -> bool:
        return self.pending.wait()
