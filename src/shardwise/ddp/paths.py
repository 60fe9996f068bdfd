"""The ways DDP reduces one gradient bucket, one small class each.

[Note: DDP reduction paths]
Every path has ``reduce(bucket)``, which starts the bucket's reduction and returns what to wait
on (None when there is nothing to wait for), and ``prescaled``: whether the bucketer multiplies
gradients by 1/world size on their way into the buckets (the averaging then costs no pass of its
own). DDP chooses its path when it is built and again only when something changes the choice:
a communication hook registered, the buckets re-planned for a hook, a join context entered or
left (seen at forward). (The static graph, unused parameters, ``gradient_as_bucket_view`` and
distributed autograd change only where PowerSGD lands its mean, read at each launch.) In order
of preference:

- ``SharedMemory``: ranks on one host, no hook: the buckets are slots of a shared segment and
  are averaged through it ([Note: same-host shared-memory reduction] in dp/shm_reduce.py);
- ``CompressedSharedMemory``: the same with torch's fp16/bf16 compression hook registered, its
  rounding done on the shared-memory path ([Note: compression on one host], compressed.py);
- ``InlinePowerSGD``: our ``powerSGD_hook`` registered, its round run by DDP on its own buckets
  ([Note: PowerSGD inside DDP], powersgd.py), the hook itself on a step that does not run it;
- ``UserHook``: any other registered hook, on every bucket (dp/comm_hooks.py);
- ``AllReduce``: ``dist.all_reduce`` of the averaged bucket over DDP's group;
- ``DividingAllReduce``: inside a join context without a hook: gradients are not averaged on
  their way in; each bucket is divided by the initial world size or by the number of ranks
  still training, then all-reduced ([Note: DDP join] in join.py);
- ``NoReduction``: one rank and no hook: the bucket is already the result.

Inside a join context a hook is called on every bucket (``UserHook``, also for PowerSGD), and a
rank that has joined shadows the others' reductions with all-zero buckets through the path
chosen for a join context, so its collectives match theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from shardwise.ddp.compressed import launch_compressed
from shardwise.ddp.powersgd import BucketPowerSGD
from shardwise.dp.buckets import Bucket, Waitable
from shardwise.dp.comm_hooks import CommHookSlot
from shardwise.dp.shm_reduce import ShmReducer


class ReductionPath:
    """One way of reducing a bucket (see [Note: DDP reduction paths])."""

    prescaled = False  # gradients are multiplied by 1/world size on their way into the bucket

    def reduce(self, bucket: Bucket) -> Waitable | None:
        raise NotImplementedError


class NoReduction(ReductionPath):
    """One rank, no hook: nothing to reduce."""

    def reduce(self, bucket: Bucket) -> None:
        return None


class AllReduce(ReductionPath):
    """The averaged bucket summed over ``group`` by ``dist.all_reduce``."""

    prescaled = True

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def reduce(self, bucket: Bucket) -> Waitable | None:
        return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)


class DividingAllReduce(ReductionPath):
    """Inside a join context: the bucket divided by ``divisor()`` (the initial world size or
    the ranks still training), then summed over ``group``."""

    def __init__(self, group: dist.ProcessGroup, divisor: Callable[[], int]):
        self.group, self.divisor = group, divisor

    def reduce(self, bucket: Bucket) -> Waitable | None:
        bucket.buffer.div_(self.divisor())
        return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)


class SharedMemory(ReductionPath):
    """The averaged bucket, a slot of ``shm``, reduced through shared memory."""

    prescaled = True

    def __init__(self, shm: ShmReducer):
        self.shm = shm

    def reduce(self, bucket: Bucket) -> Waitable:
        return self.shm.launch(bucket.index)


class CompressedSharedMemory(ReductionPath):
    """As :class:`SharedMemory`, each rank's part of the sum rounded to ``dtype``."""

    prescaled = True

    def __init__(self, shm: ShmReducer, dtype: object):
        self.shm, self.dtype = shm, dtype

    def reduce(self, bucket: Bucket) -> Waitable:
        return launch_compressed(self.shm, bucket.index, self.dtype)


class UserHook(ReductionPath):
    """The registered hook on the bucket; ``n_buckets()`` tells it which bucket is last."""

    def __init__(self, hooks: CommHookSlot, n_buckets: Callable[[], int]):
        self.hooks, self.n_buckets = hooks, n_buckets

    def reduce(self, bucket: Bucket) -> Waitable:
        return self.hooks.run(bucket, self.n_buckets())


class InlinePowerSGD(ReductionPath):
    """Our ``powerSGD_hook``'s round on DDP's own bucket when the step runs it
    (``runs(bucket)``), landing the mean in ``.grad`` when ``into_grads()`` allows; the hook
    (``fallback``) otherwise."""

    def __init__(self, rounds: BucketPowerSGD, runs: Callable[[Bucket], bool],
                 into_grads: Callable[[], bool], n_buckets: Callable[[], int],
                 fallback: UserHook):
        self.rounds, self.runs, self.into_grads = rounds, runs, into_grads
        self.n_buckets, self.fallback = n_buckets, fallback

    def reduce(self, bucket: Bucket) -> Waitable:
        if not self.runs(bucket):
            return self.fallback.reduce(bucket)
        is_last = bucket.index == self.n_buckets() - 1
        return self.rounds.launch(bucket, is_last, self.into_grads())
