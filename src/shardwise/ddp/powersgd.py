"""Our ``powerSGD_hook`` run by DDP on its own buckets, two passes over the gradients shorter.

[Note: PowerSGD inside DDP]
A communication hook sees a bucket once it is full, as one flat buffer. For PowerSGD that costs
two passes over every gradient besides the compression itself: the hook adds last step's error
to the buffer DDP has just copied the gradients into, and DDP copies the hook's result from the
buffer back into each ``.grad`` when backward ends. On a CPU, where the hook's arithmetic runs on
the cores that also run backward, those passes are part of every step. So when the registered
hook is ``shardwise.ddp.hooks.powerSGD_hook`` with a ``PowerSGDState`` that reduces over DDP's
own group, DDP runs the same round (``hooks.compress_bucket``: the same collectives in the same
order, the same arithmetic) without calling the hook, and saves both passes:

- the error is added as each gradient is copied into its bucket (``slot = grad + error`` in one
  pass, ``Bucket.addend``);
- the mean is written straight into each ``.grad`` instead of the bucket, when every parameter
  of the bucket has a contiguous gradient of its own there. Not so with
  ``gradient_as_bucket_view`` (the gradients are the bucket), unused parameters or a static
  graph (a parameter may have no ``.grad``; DDP's rules for it apply when it finishes the
  bucket), or under distributed autograd (the gradients are not in ``.grad``): then the mean
  lands in the bucket and DDP copies it as usual.

The state stays the hook's: ``error_dict`` holds each bucket's error in the bucket's layout (the
tensor the next step adds on the way in), ``q_memory_dict`` the warm-start Q's, ``iter`` the
step count. So any step can call the hook itself instead, and does where this path does not
apply: a rank that has joined (its buckets are all-zero copies, join.py) or a step taken inside
a join context; both paths issue the same collectives, so ranks may mix them. torch's own
``powerSGD_hook`` and any other hook are called as registered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.ddp import hooks
from shardwise.dp.buckets import Bucket


class BucketPowerSGD:
    """``powerSGD_hook``'s rounds on DDP's buckets (see the Note): one per DDP."""

    def __init__(self, state: hooks.PowerSGDState, group: dist.ProcessGroup):
        self.state, self.group = state, group

    @staticmethod
    def of(hook: Any, state: Any, group: dist.ProcessGroup) -> BucketPowerSGD | None:
        """The in-DDP rounds when ``hook`` is our ``powerSGD_hook`` and ``state`` reduces over
        ``group`` (its process group is ``group``, or None and ``group`` is the world)."""
        if hook is not hooks.powerSGD_hook or not isinstance(state, hooks.PowerSGDState):
            return None
        own = state.process_group
        if own is group or (own is None and group is dist.group.WORLD):
            return BucketPowerSGD(state, group)
        return None

    def addend(self, bucket: Bucket) -> torch.Tensor | None:
        """The error to add to gradients on their way into ``bucket`` in the coming backward:
        None before compression starts, without error feedback, or before the first error."""
        state = self.state
        if state.iter < state.start_powerSGD_iter or not state.use_error_feedback:
            return None
        error = state.error_dict.get(bucket.index)
        return error if error is not None and error.shape == (bucket.numel,) else None

    def launch(self, bucket: Bucket, is_last: bool, into_grads: bool) -> PowerSGDWork:
        """Start the bucket's round (the plain averaging all-reduce before compression starts).
        ``into_grads``: the caller allows landing the mean in ``.grad``; it does when every
        parameter has a gradient there that fits."""
        state = self.state
        if state.iter < state.start_powerSGD_iter:
            state.count(is_last)
            return PowerSGDWork(hooks._average(bucket.buffer, self.group), in_grads=False)
        errors = None
        if state.use_error_feedback:
            if bucket.addend is None:  # the first error (else: added on the way in)
                bucket.addend = state.error_dict[bucket.index] = torch.zeros_like(bucket.buffer)
            # from here on, the addend's slots take this step's error
            errors = [bucket.addend_slot(i) for i in range(len(bucket.params))]
        in_grads = into_grads and all(_fits(p) for p in bucket.params)
        outs = [p.grad for p in bucket.params] if in_grads else bucket.views
        future = hooks.compress_bucket(state, self.group, bucket.index, is_last, bucket.views,
                                       outs, errors, True)
        return PowerSGDWork(future, in_grads)


class PowerSGDWork:
    """A bucket's round in flight; ``in_grads``: its mean lands in the ``.grad``s, not in the
    bucket (so DDP has nothing to copy)."""

    def __init__(self, future: torch.futures.Future, in_grads: bool):
        self.future, self.in_grads = future, in_grads

    def wait(self) -> None:
        self.future.wait()


def _fits(param: torch.nn.Parameter) -> bool:
    grad = param.grad
    return (grad is not None and grad.shape == param.shape and grad.dtype == param.dtype
            and grad.is_contiguous() and not grad.is_sparse)
