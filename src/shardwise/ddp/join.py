"""DDP under torch's join context manager (uneven inputs across ranks).

[Note: DDP join] Under ``torch.distributed.algorithms.join.Join`` (``model.join()`` builds one
over this model alone), a rank that has run out of batches leaves its loop and, inside the
manager's exit, shadows every iteration the other ranks still run, one ``main_hook`` call per
iteration, issuing the same collectives in the same order with neutral values:

    still training (forward, backward)         joined (Join's loop, main_hook)
    Join.notify_join_context: all-reduce 1     Join counts non-joined ranks: all-reduce 0
    if buffers sync: all-reduce MAX of rank,   same, with -1 (the highest training rank is
      broadcast buffers from the result          the source), receive the buffers
    all-reduce 1 if this backward reduces      all-reduce 0; result > 0: reduce this iteration
    bucket collectives, used-map all-reduce    the same collectives over zero buckets

Whether buffers are broadcast in a forward depends on whether the previous forward was followed
by a reducing backward (torch's rule), which a joined rank learns from the third line. The
averaging divisor stays the initial world size (joined ranks add zeros), or with
``divide_by_initial_world_size=False`` is the count of the first line's all-reduce. When every
rank has joined, ``post_hook`` broadcasts parameters and buffers from the highest rank among the
last to join, so all replicas end equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from shardwise.ddp.unused import UnusedMap
from shardwise.dp.grad_buckets import GradBucketer, Launch

if TYPE_CHECKING:
    from shardwise.ddp.data_parallel import DistributedDataParallel


class DDPJoinHook(JoinHook):
    """Shadows a DDP iteration on a joined rank; see [Note: DDP join]."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp._will_sync_buffers():
            ddp._broadcast_buffers(common_rank(ddp.process_group, False, ddp.join_device))
        flag = torch.zeros(1, device=ddp.join_device)
        dist.all_reduce(flag, group=ddp.process_group)
        should_reduce = flag.item() > 0
        ddp._sync_buffers_next = should_reduce
        if should_reduce:
            shadow_reduction(ddp.reducer, ddp._shadow_launch, ddp._unused)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = common_rank(ddp.process_group, is_last_joiner, ddp.join_device)
        ddp._broadcast_state(src)


def shadow_reduction(bucketer: GradBucketer, launch: Launch, unused: UnusedMap | None) -> None:
    """Issue one reduction's collectives with all-zero gradients, finishing nothing: a joined
    rank's part in the training ranks' bucket collectives (and used-map all-reduce), in the same
    order."""
    works = [launch(bucket.zeros_like()) for bucket in bucketer.buckets]
    if unused is not None:
        unused.shadow()
    for work in works:
        if work is not None:
            work.wait()


def common_rank(group: dist.ProcessGroup, candidate: bool, device: torch.device) -> int:
    """The highest group rank among those passing ``candidate=True`` (one all-reduce MAX)."""
    rank = torch.tensor([dist.get_rank(group) if candidate else -1], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
    if rank.item() < 0:
        raise RuntimeError("join: no rank offered itself as the source of the model state")
    return int(rank.item())


def announce_reduction(group: dist.ProcessGroup, will_reduce: bool,
                       device: torch.device) -> None:
    """A training rank's matching all-reduce for the joined ranks' question "will this
    iteration's backward reduce?" (asynchronous; the training rank needs no answer)."""
    dist.all_reduce(torch.full((1,), float(will_reduce), device=device), group=group,
                    async_op=True)


def active_ranks(work: dist.Work) -> int:
    """The number of ranks still training: the value of Join's notification all-reduce."""
    return int(work.get_future().wait()[0].item())
