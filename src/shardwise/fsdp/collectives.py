"""FSDP's communication and its hooks into autograd, in one place.

Collectives: a unit's all-gather (shard -> full flat buffer) and its gradient reduce-scatter
(full flat gradient -> this rank's averaged shard), both through
``shardwise.distributed.fast_collectives`` so that each backend gets its fastest equivalent
collective (see [Note: fast collectives] there), issued asynchronously and waited for only when
the data is needed; an all-reduce for gradient norms.

Autograd: the pre-backward hook is a tensor hook on a unit's forward outputs (it fires when the
gradient of an output is computed, i.e. just before the unit's own backward starts); the
end-of-backward callback is queued on autograd's engine so that it runs once the whole backward
pass has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from shardwise.distributed.fast_collectives import Pending, all_gather_flat, reduce_scatter_flat


def start_all_gather(full: torch.Tensor, shard: torch.Tensor,
                     group: dist.ProcessGroup) -> Pending:
    """Issue the all-gather of every rank's ``shard`` (1D) into ``full`` (1D, world x shard)."""
    return all_gather_flat(full, shard, group, async_op=True)


def start_reduce_scatter(shard_out: torch.Tensor, full_grad: torch.Tensor,
                         group: dist.ProcessGroup) -> Pending:
    """Issue the averaging reduce-scatter of ``full_grad`` (1D, world x shard) into
    ``shard_out`` (1D): this rank gets the mean over ranks of its own part."""
    return reduce_scatter_flat(shard_out, full_grad, group, average=True, async_op=True)


def all_gather_now(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Blocking all-gather (state dicts)."""
    all_gather_flat(full, shard, group)


def all_reduce_now(t: torch.Tensor, group: dist.ProcessGroup,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Blocking in-place all-reduce (gradient norms); a no-op on one rank."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def register_pre_backward(outputs: Any, hook: Callable[[], None]) -> None:
    """Call ``hook()`` when the gradient of any tensor in ``outputs`` (any nesting of lists,
    tuples, dicts) that requires grad is computed. The hook should be idempotent per backward."""
    if not torch.is_grad_enabled():
        return
    leaves, _ = tree_flatten(outputs)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_returning_none(hook))


def _returning_none(hook: Callable[[], None]) -> Callable[[torch.Tensor], None]:
    def tensor_hook(grad: torch.Tensor) -> None:
        hook()

    return tensor_hook


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running has finished (call during backward)."""
    Variable._execution_engine.queue_callback(callback)
