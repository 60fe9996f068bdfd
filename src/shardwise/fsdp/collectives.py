"""FSDP's communication and its hooks into autograd, in one place.

Collectives: a unit's gather (every rank's chunks -> the unsharded flat buffer, see
[Note: FSDP layout]: one broadcast per rank of each large parameter's chunk straight into its
rows, one all-gather of the packed small parameters) and its gradient reduce-scatter (rank-major
flat gradient -> this rank's averaged shard), through ``shardwise.dp.fast_collectives``
so that each backend gets its fastest equivalent collective (see [Note: fast collectives]
there), issued asynchronously and waited for only when the data is needed; an all-reduce for
gradient norms.

Autograd: the end-of-backward callback is queued on autograd's engine so that it runs once the
whole backward pass has finished. (The pre-backward hook, a tensor hook on a unit's forward
outputs that fires just before the unit's own backward starts, is shared with ZeRO stage 2:
shardwise/dp/output_hooks.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise._compat import queue_callback
from shardwise.dp.fast_collectives import Pending, all_gather_flat, reduce_scatter_flat
from shardwise.fsdp.layout import UnitLayout, chunks_of, copy_from_chunks


def start_unit_gather(full: torch.Tensor, shard: torch.Tensor, layout: UnitLayout, rank: int,
                      global_ranks: Sequence[int], group: dist.ProcessGroup) -> Pending:
    """Issue the gather of every rank's ``shard`` (1D, ``layout.shard_numel``) into ``full``
    (1D, ``layout.total``: the parameters whole, back to back). Collective over ``group``:
    every rank issues the same broadcasts in the same order. The returned ``Pending`` copies
    the packed parameters out of their all-gather buffer when waited for."""
    works, own = [], []
    for _, p in layout.direct():
        dest = full[p.full_offset : p.full_offset + p.numel]
        for r, rows in chunks_of(dest, p):
            mine = shard[p.shard_offset : p.shard_offset + rows.numel()] if r == rank else None
            if mine is not None:
                own.append((rows, mine))
            if len(global_ranks) > 1:  # this rank sends its chunk straight from the shard
                works.append(dist.broadcast(rows if mine is None else mine,
                                            src=global_ranks[r], group=group, async_op=True))
    for rows, mine in own:  # copied into place while the broadcasts are under way
        rows.copy_(mine)
    if not layout.packed_numel:
        return Pending(works)
    world = len(global_ranks)
    packed = torch.empty(world * layout.packed_numel, dtype=full.dtype, device=full.device)
    gather = all_gather_flat(packed, shard[layout.packed_offset :], group, async_op=True)

    def copy_out() -> None:
        gather.wait()
        rows = packed.view(world, layout.packed_numel)
        for _, p in layout.packed():
            start = p.shard_offset - layout.packed_offset
            copy_from_chunks(full[p.full_offset : p.full_offset + p.numel],
                             rows[:, start : start + p.chunk_numel], p)

    return Pending(works, copy_out)


def start_reduce_scatter(shard_out: torch.Tensor, full_grad: torch.Tensor,
                         group: dist.ProcessGroup) -> Pending:
    """Issue the averaging reduce-scatter of ``full_grad`` (1D, world x shard) into
    ``shard_out`` (1D): this rank gets the mean over ranks of its own part."""
    return reduce_scatter_flat(shard_out, full_grad, group, average=True, async_op=True)


def then_average_across(first: Pending, out: torch.Tensor,
                        group: dist.ProcessGroup) -> Pending:
    """Hybrid sharding: once ``first`` (the reduce-scatter within the shard group) is done,
    all-reduce its result ``out`` across the replicate ``group`` and divide by its size, so
    ``out`` is the mean over every rank of the mesh."""
    size = dist.get_world_size(group)

    def finish() -> None:
        first.wait()
        if size > 1:
            dist.all_reduce(out, group=group)
            out.div_(size)

    return _ThenAverage(first, finish)


class _ThenAverage(Pending):
    """``then_average_across``'s result: its all-reduce is issued only when waited for."""

    def __init__(self, first: Pending, finish: Callable[[], None]):
        super().__init__([], finish)
        self.first = first

    def wait_posted(self) -> None:
        """Wait for what was issued (the reduce-scatter) and issue nothing more ([Note: a
        backward that raised], root.py)."""
        self.first.wait()


# [Note: FSDP under torch.compile]
# A unit's forward hooks gather and free parameters: collectives waited for through c10d's
# ``Work`` objects, storage resized in place, module attributes swapped, Python state moved on.
# None of that belongs in a graph, and dynamo cannot trace a ``Work`` (a pybind object): traced,
# each hook broke the graph in two. So the hooks are wrapped in ``torch.compiler.disable``, as
# torch's FSDP2 wraps its own: with ``torch.compile(model)`` or ``block.compile()`` after
# ``fully_shard``, a unit's hooks run eagerly around its compiled forward and the forward is one
# graph whose inputs are the gathered parameters. Where a unit is called inside a compiled
# frame (a root whose forward loops over compiled units), dynamo runs that frame eagerly and
# compiles each unit's forward, as it does for torch's FSDP2. The backward hooks run in
# autograd's engine, outside dynamo, and need no wrapping.
# tests/fsdp/test_compile.py counts the graph breaks and compares the losses with eager.


def run_eagerly(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` made opaque to torch.compile: it always runs as plain Python
    (see [Note: FSDP under torch.compile])."""
    return torch.compiler.disable(hook, recursive=True)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running has finished (call during backward)."""
    queue_callback(callback)
