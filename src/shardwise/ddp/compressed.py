"""torch's fp16/bf16 compression hooks, run through the same-host shared-memory reduction.

[Note: compression on one host] ``fp16_compress_hook`` and ``bf16_compress_hook`` (torch's in
``ddp_comm_hooks.default_hooks`` and ours in ``shardwise.ddp.hooks``) do three things to a
bucket: round each rank's gradients to half precision and divide them by the world size, sum
them over the group in half precision, and write the half-precision sum back into the bucket.
They exist to halve the bytes on a slow link. Between the ranks of one host there is no link:
the shared-memory reduction ([Note: same-host shared-memory reduction]) reads the other ranks'
slots directly, at a fraction of gloo's cost, and halving the bytes would save nothing there.
So when DDP's buckets live in shared memory and the registered hook is one of these four with
DDP's own group (or ``None``, the world, when that is DDP's group), DDP computes what the hook
computes, the mean in half precision, on the shared-memory path instead of calling it: the
gradients are divided by the world size on their way into the bucket and summed in float32, as
without a hook, and each part of the sum is rounded to half precision by the rank that summed it,
on the reducer's worker thread, before the others copy it (so every rank ends with the same
bits). The result is the float32 mean rounded once, the half-precision value nearest to it; the
hook rounds each rank's gradients before the sum and gloo rounds after every add, so the hook's
result can differ from it by about one unit in the last place.

Any other hook, or these with another group or across hosts, is called as registered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardwise.ddp import hooks as our_hooks
from shardwise.dp.shm_reduce import ShmReducer, ShmWork

_HALF = {
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
    our_hooks.fp16_compress_hook: torch.float16,
    our_hooks.bf16_compress_hook: torch.bfloat16,
}


def compression_of(hook: Any, state: Any, group: dist.ProcessGroup) -> torch.dtype | None:
    """The half-precision dtype when ``hook`` is a compression hook reducing over ``group``
    (its state is the group, or None for the world when ``group`` is the world), else None."""
    dtype = _HALF.get(hook)
    if dtype is None:
        return None
    if state is group or (state is None and group is dist.group.WORLD):
        return dtype
    return None


def launch_compressed(shm: ShmReducer, index: int, dtype: torch.dtype) -> ShmWork:
    """Bucket ``index`` (already averaged on its way in) summed, each rank's part rounded to
    ``dtype`` on the reducer's worker thread before the other ranks read it (see the Note)."""

    def finish(part: torch.Tensor) -> None:
        part.copy_(part.to(dtype))

    return shm.launch(index, finish=finish)
