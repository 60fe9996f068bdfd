"""ZeRO stage 1 overlapped with DDP's backward: ``overlap_with_ddp=True`` and the hooks
``hook_with_zero_step`` / ``hook_with_zero_step_interleaved`` (torch's names and signatures).

[Note: ZeRO step inside DDP's backward]
With ``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` the optimizer does not step in
``step()``; it is attached to a ``shardwise.DistributedDataParallel`` by wrapping a
communication hook::

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))

Ownership follows DDP's buckets, as in torch: bucket ``i`` (with all its parameters) belongs to
rank ``i % world_size``, whose local optimizer holds the state of those parameters only, and the
parameters become views into one flat buffer per bucket. In every backward, once a bucket has
been reduced its owner steps that bucket's parameters with the reduced gradients and broadcasts
the bucket's flat parameters (one ``dist.broadcast`` per bucket, in place). The interleaved
variant does this for bucket ``i - 1`` right after bucket ``i``'s reduction is launched, while
backward computes earlier layers; the plain variant does all buckets when the last one is
reduced. All collectives are issued from the thread that runs backward, in bucket order, so
every rank issues them in the same order (torch issues them from collective callbacks and
refuses gloo for fear of hangs; ours runs on gloo). The broadcasts are waited for at the last
bucket, so parameters are equal on all ranks when backward returns.

Warm-up, as torch documents: the first two backward passes (three with a static graph) step
nothing, torch's DDP needing them to settle its buckets; ours keeps the count so that a program
gives the same parameters on both. The inner hook must issue its collectives when called
(``allreduce_hook``, the compression hooks); PowerSGD, which issues its second all-reduce from a
collective's callback, is refused. One parameter group only, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise.distributed.groups import global_rank
from shardwise.dp.comm_hooks import CommHook, GradBucket

if TYPE_CHECKING:
    from shardwise.ddp.data_parallel import DistributedDataParallel
    from shardwise.dp.buckets import Bucket
    from shardwise.zero.optimizer import ZeroRedundancyOptimizer

WARMUP_ITERATIONS = 2  # backward passes without a step; one more with a static graph
_CALLBACK_HOOKS = ("powerSGD_hook", "batched_powerSGD_hook")


class OverlapState:
    """One ZeroRedundancyOptimizer attached to one DDP model: who owns which bucket, the flat
    parameter buffer of each bucket, and the current backward pass's pending work."""

    def __init__(self, zero: ZeroRedundancyOptimizer, ddp: DistributedDataParallel):
        self.zero, self.group = zero, zero.process_group
        self.buckets: list[Bucket] = ddp.reducer.buckets
        self.rank, self.world = zero.rank, zero.world_size
        self.owner = [i % self.world for i in range(len(self.buckets))]
        self.flats = [_flatten_params(b.params) for b in self.buckets]
        self.warmup = WARMUP_ITERATIONS + (1 if ddp.static_graph else 0)
        self.iteration = 0
        self.pending: dict[int, tuple[torch.futures.Future, GradBucket]] = {}
        self.broadcasts: list[dist.Work] = []

    def owned_params(self, rank: int) -> list[torch.Tensor]:
        return [p for b, o in zip(self.buckets, self.owner) if o == rank for p in b.params]

    def stepping(self) -> bool:
        return self.iteration >= self.warmup

    def handle(self, index: int) -> None:
        """Bucket ``index`` is reduced (wait for it): its owner steps its parameters, then its
        flat parameters are broadcast from the owner (asynchronously)."""
        future, _ = self.pending.pop(index)
        reduced = future.wait()
        if isinstance(reduced, (list, tuple)):
            reduced = reduced[0]
        if self.owner[index] == self.rank:
            self.zero._step_bucket(self.buckets[index], reduced)
        if self.world > 1:
            src = global_rank(self.group, self.owner[index])
            self.broadcasts.append(
                dist.broadcast(self.flats[index], src=src, group=self.group, async_op=True))

    def warming_up(self, bucket: GradBucket) -> bool:
        """True during the warm-up passes (the last bucket of one ends it)."""
        if self.stepping():
            return False
        if bucket.is_last():
            self.end_iteration()
        return True

    def end_iteration(self) -> None:
        """After the last bucket: the broadcasts land, the next pass starts clean."""
        for work in self.broadcasts:
            work.wait()
        self.broadcasts.clear()
        self.pending.clear()
        self.iteration += 1


def hook_with_zero_step(hook: CommHook, ddp: DistributedDataParallel,
                        zero: ZeroRedundancyOptimizer, shard_buckets: bool = False
                        ) -> Callable[[Any, Any], torch.futures.Future]:
    """``hook`` plus ZeRO's step: when the last bucket has been reduced, each bucket's owner
    steps it and broadcasts its parameters (see [Note: ZeRO step inside DDP's backward])."""
    overlap = _attach(hook, ddp, zero, shard_buckets)

    def hook_and_step(state: Any, bucket: GradBucket) -> torch.futures.Future:
        future = hook(state, bucket)
        if overlap.warming_up(bucket):
            return future
        overlap.pending[bucket.index()] = (future, bucket)
        if bucket.is_last():
            for index in range(len(overlap.buckets)):
                overlap.handle(index)
            overlap.end_iteration()
        return future

    return hook_and_step


def hook_with_zero_step_interleaved(hook: CommHook, ddp: DistributedDataParallel,
                                    zero: ZeroRedundancyOptimizer, shard_buckets: bool = False
                                    ) -> Callable[[Any, Any], torch.futures.Future]:
    """``hook`` plus ZeRO's step, bucket by bucket: bucket ``i - 1`` is stepped and broadcast as
    soon as bucket ``i``'s reduction has been launched, while backward goes on."""
    overlap = _attach(hook, ddp, zero, shard_buckets)

    def hook_and_step(state: Any, bucket: GradBucket) -> torch.futures.Future:
        future = hook(state, bucket)
        if overlap.warming_up(bucket):
            return future
        index = bucket.index()
        overlap.pending[index] = (future, bucket)
        if index > 0:
            overlap.handle(index - 1)
        if bucket.is_last():
            overlap.handle(index)
            overlap.end_iteration()
        return future

    return hook_and_step


def _attach(hook: CommHook, ddp: Any, zero: Any, shard_buckets: bool) -> OverlapState:
    from shardwise.ddp.data_parallel import DistributedDataParallel
    from shardwise.zero.optimizer import ZeroRedundancyOptimizer

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"hook_with_zero_step needs the shardwise.DistributedDataParallel model "
                        f"the hook will be registered on, got {type(ddp).__name__}")
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero.overlap_with_ddp:
        raise ValueError("hook_with_zero_step needs a shardwise.ZeroRedundancyOptimizer "
                         "constructed with overlap_with_ddp=True")
    if shard_buckets:
        raise ValueError("shard_buckets=True (a bucket split between several owners) is not "
                         "supported; each bucket belongs to one rank")
    if getattr(hook, "__name__", "") in _CALLBACK_HOOKS:
        raise ValueError(f"{hook.__name__} issues collectives from a collective's callback, "
                         "whose order against ZeRO's broadcasts would differ between ranks; "
                         "use allreduce_hook or a compression hook with overlap_with_ddp")
    if dist.get_world_size(ddp.process_group) != zero.world_size or \
            dist.get_rank(ddp.process_group) != zero.rank:
        raise ValueError("the ZeroRedundancyOptimizer and the DistributedDataParallel model "
                         "must use the same process group")
    ddp._use_hook_buckets()  # the buckets the hook will see, before ownership follows them
    overlap = OverlapState(zero, ddp)
    zero._attach_overlap(overlap)
    return overlap


def _flatten_params(params: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding ``params``' values; each parameter becomes a view into it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat
