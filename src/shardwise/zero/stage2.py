"""ZeroDataParallel: ZeRO stage 2, gradients sharded like the optimizer state.

Used like DistributedDataParallel plus ZeroRedundancyOptimizer, with the optimizer handed to
the wrapper so that it knows who owns which parameter::

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=1e-3)
    model = ZeroDataParallel(model, optimizer)      # stage 2
    loss_fn(model(x), y).backward()                 # each rank keeps only its owned gradients
    model.clip_grad_norm_(1.0)                      # norm over all shards
    optimizer.step()

[Note: stage 2 buckets]
Gradients are bucketed as in DDP (shardwise/dp/grad_buckets.py): the same bucket sizes, filled
in backward's order, each gradient scaled by 1/world size on its way in (so a sum is the
average). Inside a bucket the parameters are laid out by owning rank, so each owner's gradients
form one contiguous part of the flat buffer. When a bucket is full it is reduce-scattered into
those parts (zero/collectives.py, ``OwnerScatter``): each rank receives only the sum of its own
part, into that bucket's part buffer (allocated at the first step, reused by every step), and
keeps nothing of the others'. On one host the reduce-scatter goes through shared memory (each
rank sums its own part of every rank's copy straight into its part buffer, no socket); with NCCL
it is ``dist.reduce_scatter``; otherwise (gloo across hosts) one ``dist.reduce`` per owner of
the bucket. The owner's ``.grad``s become views into its part buffer. Each parameter's ``.grad``
is dropped as soon as it is copied into its bucket; a bucket's buffer exists only from its first
gradient until it is launched (on the shared-memory path, where it is the bucket's region of
a ring whenever that region may be filled, so no copy is made: see
[Note: stage 2 shared-memory ring] in shm_ring.py) or reduced. On the shared-memory path a
launched bucket holds no memory of its own and waiting for it waits for this rank's sum only,
so the buckets in flight are not bounded and backward never stops for a reduction; on the other
paths (private bucket buffers) at most two are in flight. Freeing every gradient in backward
would make glibc hand the heap's top back and fault it in again every step unless its
thresholds are raised, which the optimizer does on the CPU (see
[Note: heap kept resident across steps] in memory/heap.py). So during backward a rank holds
its owned gradients plus a few buckets, and after backward only its owned gradients: at most
1/N of all gradients plus one parameter (see [Note: ZeRO partition]). ``no_sync()``
accumulates full local gradients (no collective), as DDP does; the next backward outside it
reduces the sums. A registered communication hook replaces the reduce-scatter (it all-reduces
the bucket, which is then not pre-scaled; each owner copies its part out).

With the optimizer's ``partition="elements"`` ([Note: ZeRO element partition] in elements.py)
a bucket is laid out in the element layout's order instead, so that each rank's element range
is one contiguous part of it (a parameter may straddle two parts); the same reduce-scatter
delivers each rank the sum of its range, and the reduced gradients become the ``.grad`` of the
optimizer's pieces (views into this rank's part buffer): no parameter's ``.grad`` is set.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.ddp.unused import UnusedMap
from shardwise.dp.buckets import Bucket, BucketSizes, Waitable
from shardwise.dp.comm_hooks import CommHook, CommHookSlot
from shardwise.dp.data_parallel import (
    broadcast_buffers,
    clip_by_total_norm,
    sharded_grad_norm,
    sync_module_state,
)
from shardwise.dp.grad_buckets import GradBucketer, Holding
from shardwise.dp.output_hooks import register_pre_backward
from shardwise.zero import collectives as zc
from shardwise.zero.optimizer import ZeroRedundancyOptimizer

BUCKETS_IN_FLIGHT = 2
SHM_RING = 3  # the shared-memory ring holds up to this many times the largest bucket


class ZeroDataParallel(nn.Module):
    """Data parallelism with sharded gradients (ZeRO stage 2) over ``optimizer``'s group.

    ``optimizer`` must be a ZeroRedundancyOptimizer over this module's trainable parameters; it
    decides which rank owns which gradient. ``bucket_cap_mb`` (default 25),
    ``find_unused_parameters``, ``broadcast_buffers`` and ``init_sync`` mean what they mean for
    DistributedDataParallel. After backward, ``param.grad`` is set (averaged over ranks) on the
    owning rank only and is ``None`` elsewhere. It is ZeRO stage 2 only: stage 1 is
    DistributedDataParallel with a ZeroRedundancyOptimizer, stage 3 FullyShardedDataParallel.
    """

    def __init__(self, module: nn.Module, optimizer: ZeroRedundancyOptimizer, *,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, init_sync: bool = True):
        super().__init__()
        _check_args(module, optimizer)
        self.module = module
        self.optimizer = optimizer
        self.process_group = optimizer.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self._elements = optimizer._elements
        # trainable parameter -> owning rank, or (element partition) its place in the layout
        self._owner = (optimizer.owners() if self._elements is None
                       else self._elements.positions)
        self._pieces = {} if self._elements is None else self._elements.piece_of()
        _check_coverage(module, self._owner)
        if init_sync:
            sync_module_state(module, self.process_group)
        self.reducer = GradBucketer(
            list(module.named_parameters()), BucketSizes.default(bucket_cap_mb), self._launch,
            self._finish, allow_unused=find_unused_parameters, wrapper="ZeroDataParallel",
            holding=sharded_holding(self._owner.__getitem__, self._slot_for),
        )  # laid out by owner, or by layout position under the element partition
        # no rank used them: their .grad goes back to None once the reduction is over
        self.reducer.add_policy(UnusedMap(self.process_group, find_unused_parameters,
                                          drop=self._drop_unused))
        buckets = self.reducer.buckets
        self._parts = [owner_parts(b, self._owner, self.world_size) if self._elements is None
                       else self._elements.bucket_parts(b.params) for b in buckets]
        self._scatter = zc.OwnerScatter(self.process_group, buckets, SHM_RING)
        weakref.finalize(self, self._scatter.close)
        # bucket index -> this rank's part of it: the owned gradients, made on first use and
        # reused by every step (their .grads are views of it)
        self._outs: dict[int, torch.Tensor] = {}
        self._set_reduction(hooked=False)
        self._holds_reduced = False  # owned grads hold a reduced (averaged) sum
        self._reduced: list[tuple[torch.Tensor, list[nn.Parameter]]] = []  # buffer, its params
        self._comm_hooks = CommHookSlot("ZeroDataParallel")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.reducer.end_abandoned_backward()  # the last backward may have raised
        if torch.is_grad_enabled():
            self._check_grads_cleared()
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_buffers(self.module, self.process_group)
        output = self.module(*inputs, **kwargs)
        # a second backward through this output checks too
        register_pre_backward(output, self._check_grads_cleared)
        return output

    def no_sync(self) -> AbstractContextManager[None]:
        """Skip gradient reduction inside the block; full gradients accumulate locally."""
        return self.reducer.paused()

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` (torch's DDP contract: the hook's
        future holds the bucket averaged over the group, e.g. ``fp16_compress_hook``) instead
        of the reduce-scatter to the owners; each owner copies its part out. A hook
        all-reduces, so it moves as many bytes as DDP's reduction: worth it for compressing
        hooks only. Once."""
        self._comm_hooks.register(state, hook)
        self._set_reduction(hooked=True)

    def _set_reduction(self, hooked: bool) -> None:
        """How gradients enter the buckets, per [Note: stage 2 buckets]: scaled by 1/world
        on their way in (the reduce-scatter's sum is then the average; a hook divides itself),
        and the buckets in flight bounded unless the reduce-scatter runs through shared memory
        (whose in-flight buckets hold no memory of their own)."""
        if self.reducer.in_backward:
            raise RuntimeError("ZeroDataParallel: a communication hook must be registered "
                               "outside backward")
        self.reducer.scale = 1 / self.world_size if self.world_size > 1 and not hooked else None
        bounded = hooked or self._scatter.bounds_in_flight
        self.reducer.max_in_flight = BUCKETS_IN_FLIGHT if bounded else None

    def owned_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters whose gradients this rank keeps whole (none under the
        element partition, where it keeps its pieces' gradients: ``owned_gradients``)."""
        if self._elements is not None:
            return []
        return [p for p in self.module.parameters() if self._owner.get(p) == self.rank]

    def owned_gradients(self) -> list[torch.Tensor]:
        """The reduced gradients this rank keeps: its owned parameters' ``.grad`` or, under
        the element partition, its pieces'."""
        if self._elements is None:
            return [p.grad for p in self.owned_parameters() if p.grad is not None]
        return [view.grad for _, view in self._pieces.values() if view.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all gradients by their global norm, as torch.nn.utils.clip_grad_norm_ would on
        the unsharded gradients. Each rank computes the norm of its owned gradients and one
        all-reduce (sum of p-th powers, or max for inf) combines them; returns the total norm."""
        grads = self.owned_gradients()
        total = sharded_grad_norm(grads, norm_type, self.process_group, self._device())
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"non-finite ({total.item()}), so it cannot be clipped")
        clip_by_total_norm(grads, max_norm, total)
        return total

    def _device(self) -> torch.device:
        return next(iter(self._owner)).device

    def _slot_for(self, bucket: Bucket) -> torch.Tensor | None:
        """Where a bucket is filled: its shared-memory region when it may be (not with a
        hook)."""
        if self._comm_hooks.hook is not None:
            return None
        return self._scatter.slot_for(bucket)

    def _launch(self, bucket: Bucket) -> Waitable | None:
        if self._comm_hooks.hook is not None:
            return self._comm_hooks.run(bucket, len(self.reducer.buckets))
        out = self._part_of(bucket) if self.world_size > 1 else None
        return self._scatter.launch(bucket, self._parts[bucket.index], out)

    def _part_of(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's part of ``bucket`` (None when it owns none of it): one buffer per
        bucket, allocated at its first reduction and reused by every later one."""
        start, end = self._parts[bucket.index][self.rank]
        if end <= start:
            return None
        part = self._outs.get(bucket.index)
        if part is None:
            first = bucket.params[0]
            part = self._outs[bucket.index] = torch.empty(end - start, dtype=first.dtype,
                                                          device=first.device)
        return part

    def _finish(self, bucket: Bucket) -> None:
        if self._elements is not None:
            self._finish_elements(bucket)
            return
        start, end = self._parts[bucket.index][self.rank]
        mine = [i for i, p in enumerate(bucket.params) if self._owner[p] == self.rank]
        for param in bucket.params:
            if self._owner[param] != self.rank:
                param.grad = None
        if not mine:
            return
        if self._comm_hooks.hook is not None:  # the hook's future holds the average
            part = self._part_of(bucket).copy_(bucket.allocate()[start:end])
        elif self.world_size == 1:
            part = bucket.allocate()[start:end]
        else:  # the sum of gradients scaled by 1/world on their way in: the average
            part = self._outs[bucket.index]
        for i in mine:
            param, offset = bucket.params[i], bucket.offsets[i] - start
            param.grad = part[offset : offset + param.numel()].view_as(param)
        self._reduced.append((part, [bucket.params[i] for i in mine]))
        self._holds_reduced = True

    def _finish_elements(self, bucket: Bucket) -> None:
        """The element partition's end of a bucket's reduction: no parameter keeps a
        ``.grad``; each of this rank's pieces in the bucket gets its slice of the reduced part
        as its ``.grad``."""
        start, end = self._parts[bucket.index][self.rank]
        for param in bucket.params:
            param.grad = None
        if end <= start:
            return
        part = self._reduced_part(bucket, start, end)
        views = []
        for param, offset in zip(bucket.params, bucket.offsets):
            mine = self._pieces.get(param)
            if mine is None:
                continue
            piece, view = mine
            at = offset + piece.start - start
            view.grad = part[at:at + piece.numel]
            views.append(view)
        self._reduced.append((part, views))
        self._holds_reduced = True

    def _reduced_part(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """This rank's reduced part of ``bucket``, its [start, end) elements."""
        if self._comm_hooks.hook is not None:  # the hook's future holds the average
            return self._part_of(bucket).copy_(bucket.allocate()[start:end])
        if self.world_size == 1:
            return bucket.allocate()[start:end]
        return self._outs[bucket.index]

    def _drop_unused(self, params: list[nn.Parameter]) -> None:
        """No rank used ``params`` in this reduction: the owner's zero ``.grad`` goes back to
        None (others hold none), as DDP and torch leave it, so the optimizer skips them."""
        for param in params:
            param.grad = None
            if param in self._pieces:
                self._pieces[param][1].grad = None

    def _check_grads_cleared(self) -> None:
        """Reduced gradients must be cleared before the next backward: a rank's reduced sum
        would otherwise enter the next reduction as if it were its own local gradient (and
        autograd would add the new gradient into the reduced buffer in place). Checked in
        forward and again when a backward reaches the output, before any gradient is added: a
        second backward through one forward (``retain_graph``) gave wrong gradients silently.
        Cleared means ``.grad`` set to ``None`` or zeroed; the zero test runs on the few reduced
        bucket buffers (the owned gradients are views into them), with one device sync in all,
        not one per parameter."""
        if not self._holds_reduced:
            return
        buffers = [buf for buf, params in self._reduced if any(p.grad is not None for p in params)]
        if buffers and bool(torch.stack([buf.any() for buf in buffers]).any()):
            raise RuntimeError(
                "ZeroDataParallel: the gradients reduced by the last backward are still set. "
                "Call optimizer.zero_grad() after optimizer.step(); to accumulate gradients "
                "over micro-batches, or over several backward passes through one forward, run "
                "all but the last inside model.no_sync() (or sum the losses into one backward)."
            )
        self._holds_reduced = False
        self._reduced.clear()


def sharded_holding(owner_of: Callable[[nn.Parameter], int],
                    buffer_for: Callable[[Bucket], torch.Tensor | None] | None = None
                    ) -> Holding:
    """How stage 2 holds gradients in the core's buckets (see [Note: stage 2 buckets]): laid out
    by owner, ``.grad`` dropped once copied, buffers only while in use (``buffer_for``: a
    shared-memory region when it may be filled), at most ``BUCKETS_IN_FLIGHT`` buckets in flight
    (ZeroDataParallel lifts that bound on the shared-memory path)."""
    return Holding(release_grads=True, lazy_buffers=True, max_in_flight=BUCKETS_IN_FLIGHT,
                   layout_key=owner_of, buffer_for=buffer_for)


def owner_parts(bucket: Bucket, owner: dict[torch.Tensor, int], world: int) -> list[zc.Part]:
    """Per rank, the (start, end) elements of ``bucket`` holding its owned gradients (the
    bucket is laid out by owner; empty ``(0, 0)`` where a rank owns none of it)."""
    parts: list[zc.Part | None] = [None] * world
    for i, param in enumerate(bucket.params):
        rank, start = owner[param], bucket.offsets[i]
        first = parts[rank]
        parts[rank] = (start if first is None else first[0], start + param.numel())
    return [part or (0, 0) for part in parts]


def _check_args(module: Any, optimizer: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"ZeroDataParallel wraps an nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(
            "ZeroDataParallel needs the shardwise.ZeroRedundancyOptimizer over the module's "
            f"parameters (it says which rank owns which gradient), got {type(optimizer).__name__}"
        )


def _check_coverage(module: nn.Module, owner: dict[torch.Tensor, int]) -> None:
    named = dict(module.named_parameters())
    missing = [n for n, p in named.items() if p.requires_grad and p not in owner]
    if missing:
        raise ValueError(f"ZeroDataParallel: these trainable parameters are not in the "
                         f"optimizer, so no rank would own their gradients: {missing}")
    kept = {id(p) for p in named.values()}
    foreign = sum(1 for p in owner if id(p) not in kept)
    if foreign:
        raise ValueError(f"ZeroDataParallel: the optimizer holds {foreign} parameters that are "
                         "not this module's")
