"""FSDP's communication and its hooks into autograd, in one place.

Collectives: a unit's gather (every rank's chunks -> the unsharded flat buffer, see
[Note: FSDP layout]: one broadcast per rank of each large parameter's chunk straight into its
rows, one all-gather of the packed small parameters) and its gradient reduce-scatter (rank-major
flat gradient -> this rank's averaged shard), through ``shardwise.dp.fast_collectives``
so that each backend gets its fastest equivalent collective (see [Note: fast collectives]
there), issued asynchronously and waited for only when the data is needed; an all-reduce for
gradient norms. A unit's gather path is one of two objects chosen once per unit with its full
buffer (flat_param.py): ``CollectiveGather`` (the gather above, into memory held only while
unsharded) or ``HostSharedGather`` (parameters held whole once per host: nothing to gather);
its reduction path is one of reduction.py's. Beside those, every other call FSDP makes into
``torch.distributed``'s collectives or point-to-point lives here too, each function saying
what it sends and why:
the direct exchanges of gradient rows ([Note: direct gradient reduction], reduction.py),
the barrier of ranks that share parameters on one host, the agreement on unused parameters,
the all-gathers that tell every rank a mesh's grid, and FSDP1's broadcast of optimizer state.
tests/test_layering.py holds the rule.

Autograd: the end-of-backward callback is queued on autograd's engine so that it runs once the
whole backward pass has finished. (The pre-backward hook, a tensor hook on a unit's forward
outputs that fires just before the unit's own backward starts, is shared with ZeRO stage 2:
shardwise/dp/output_hooks.py.)

[Note: unshard buffer pool]
A unit's ``full_data`` keeps one storage for its life ([Note: flat parameters]): autograd's saved
tensors point at it. Unsharding gives that storage memory, resharding takes it away. With
``resize_`` on the CPU that is one ``malloc`` and one ``free`` of the whole unit per gather: a
unit's buffer (tens of MB) is above glibc's largest mmap threshold, so every gather maps fresh
pages and faults each of them in (a zero-filled page per 4 KiB: about as much CPU as copying
the buffer three to four times), and every reshard unmaps them. On the FSDP benchmark GPT that
was a third of a GB of fresh pages per rank and step, in forward and again in backward.

The pool instead keeps the memory a unit gives back at reshard (``give``: its storage's data
pointer is swapped into an empty holder storage) and hands it to the next unit of the same size
that unshards (``take``: swapped back into that unit's empty storage), so the pages stay
resident and are written without faults. No value changes: every gather overwrites all of the
buffer. The pool never holds more buffers of a size than were unsharded at once (a buffer joins
it only when a unit reshards, and leaves when a unit unshards), so it adds nothing to the peak
of gathered memory; and it holds a buffer only from a unit's reshard to the gathers that follow
at once (the next unit's pre-forward in forward, the prefetch issued by the same post-backward
in backward). What no gather took then is freed: the pool is emptied after each pre-forward's
gathers and each post-backward's prefetch, at the end of the root's forward and at the end of
backward (unit.py, root.py), so no pooled buffer is held while a unit computes, nor through the
optimizer step or between steps. Per step, the first gathers of forward (the root and the units
gathered with it) and the first prefetch of backward allocate; every other gather reuses.
One pool per root unit, so the trees of different models share nothing.

Only for CPU storages, and only where torch has ``UntypedStorage._swap_data_ptr_``; elsewhere
(and on CUDA, whose caching allocator already reuses blocks) ``resize_`` does the work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise._compat import queue_callback
from shardwise.dp.fast_collectives import Pending, all_gather_flat, reduce_scatter_flat
from shardwise.fsdp.layout import UnitLayout, chunks_of, copy_from_chunks

if TYPE_CHECKING:
    from shardwise.fsdp.flat_param import FlatParamHandle


# ---- memory handed from unit to unit ([Note: unshard buffer pool]) ------------------------
def _swappable(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cpu" and hasattr(storage, "_swap_data_ptr_")


class StoragePool:
    """Free unit buffers by (bytes, device); see [Note: unshard buffer pool]."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list[torch.UntypedStorage]] = {}

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a pooled buffer of ``nbytes``; False if none is free (the
        caller allocates)."""
        if storage.nbytes() or not _swappable(storage):
            return False
        free = self._free.get((nbytes, str(storage.device)))
        if not free:
            return False
        storage._swap_data_ptr_(free.pop())
        return True

    def give(self, storage: torch.UntypedStorage) -> bool:
        """Move ``storage``'s memory into the pool, leaving it empty; False if it cannot be
        pooled (the caller frees it)."""
        if not storage.nbytes() or not _swappable(storage):
            return False
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._free.setdefault((holder.nbytes(), str(holder.device)), []).append(holder)
        return True

    def pooled_bytes(self) -> int:
        """Bytes of free buffers the pool holds right now."""
        return sum(s.nbytes() for free in self._free.values() for s in free)

    def clear(self) -> None:
        """Let every pooled buffer go (freed when nothing else holds it)."""
        self._free.clear()


# ---- collectives ----------------------------------------------------------------------------
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


class CollectiveGather:
    """A unit's gather path where each rank holds only its rows: each unshard takes memory for
    the unit's full buffer (from the root's pool, [Note: unshard buffer pool]
    above) and gathers every rank's rows into it (``start_unit_gather``); each
    reshard gives the memory back."""

    def __init__(self, handle: FlatParamHandle):
        self.handle = handle

    def start(self) -> Pending | None:
        """Issue the gather into the unit's full buffer; what to wait for."""
        handle = self.handle
        storage = handle.full_data.untyped_storage()
        nbytes = handle.layout.total * handle.full_data.element_size()
        if handle.storage_pool is None or not handle.storage_pool.take(storage, nbytes):
            storage.resize_(nbytes)
        return start_unit_gather(handle.full_data, handle.gather_source(), handle.layout,
                                 handle.rank, handle.global_ranks, handle.group)

    def free(self) -> None:
        """Give the full buffer's memory back (to the pool, else to the allocator)."""
        handle = self.handle
        storage = handle.full_data.untyped_storage()
        if handle.storage_pool is None or not handle.storage_pool.give(storage):
            storage.resize_(0)
        handle.released_bytes = 0  # of the full buffer's pages, by release_param_rows

    def unsharded_bytes(self) -> int:
        return self.handle.full_data.untyped_storage().nbytes()


class HostSharedGather:
    """A unit's gather path where its ranks hold the parameters whole in one mapping per host
    for the unit's life ([Note: parameters shared on one host], host_params.py): an unshard
    gathers nothing, a reshard frees nothing, and nothing is allocated for either."""

    def start(self) -> Pending | None:
        return None

    def free(self) -> None:
        pass

    def unsharded_bytes(self) -> int:
        return 0


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


def exchange_rows(chunks: dict[int, torch.Tensor], rank: int,
                  reads: Sequence[tuple[int, torch.Tensor]], global_ranks: Sequence[int],
                  group: dist.ProcessGroup, tag: int) -> list[Any]:
    """One direct parameter's point-to-point exchange ([Note: direct gradient reduction],
    reduction.py), issued asynchronously under ``tag``: this rank sends each other rank
    ``r`` its rows ``chunks[r]`` straight out of the gradient, and receives each ``(r, buf)`` of
    ``reads`` (``r``'s copy of this rank's rows) into ``buf``. Returns the works, sends first."""
    works = [dist.isend(rows, global_ranks[r], group=group, tag=tag)
             for r, rows in chunks.items() if r != rank]
    for r, buf in reads:
        works.append(dist.irecv(buf, global_ranks[r], group=group, tag=tag))
    return works


def host_barrier(group: dist.ProcessGroup) -> None:
    """A barrier over ``group``, whose ranks hold a unit's parameters in one mapping per host
    ([Note: parameters shared on one host], host_params.py): once it returns, every rank's
    rows are written (after the mapping is filled) or no longer read (around the root's
    forward, at the end of backward)."""
    dist.barrier(group=group)


def max_over(flags: torch.Tensor, groups: Sequence[dist.ProcessGroup | None]) -> set[int]:
    """All-reduce ``flags`` (1D) in place with MAX over each group of ``groups`` that has more
    than one rank, in order: a flag is then set wherever any rank of the mesh set it (which
    parameters any rank had a gradient for: reduction.py). Returns the ids of the groups it
    ran over (each was also a barrier)."""
    synced: set[int] = set()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            synced.add(id(group))
    return synced


def gather_from_each(mine: torch.Tensor, group: dist.ProcessGroup | None = None
                     ) -> list[torch.Tensor]:
    """All-gather a small tensor (the same shape on every rank) from each rank of ``group``
    (default: the world), in group rank order: how every rank learns the grid of a mesh made
    from process groups (fsdp1/args.py, tp_params.py)."""
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return rows


def broadcast_from(buf: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Broadcast ``buf`` in place from global rank ``src`` over ``group``: FSDP1's optimizer
    state, tensor by tensor, from rank 0 to every rank (fsdp1/state_broadcast.py)."""
    dist.broadcast(buf, src, group=group)


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
