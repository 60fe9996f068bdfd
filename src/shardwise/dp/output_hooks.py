"""Running a wrapper's own step when a backward pass reaches the output of its forward.

FSDP gathers a unit's parameters there ([Note: FSDP schedule] in fsdp/root.py), and ZeRO stage 2
checks that the last reduction's gradients were cleared before any new gradient is added to
them (zero/stage2.py). Both hook the output's tensors, which a backward reaches before any node
of the forward that made them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise._compat import tree_flatten


def register_pre_backward(outputs: Any, hook: Callable[[], None]) -> None:
    """Call ``hook()`` when the gradient of any tensor in ``outputs`` (any nesting of lists,
    tuples, dicts) that requires grad is computed. The hook should be idempotent per backward.
    Nothing when grad mode is off (no backward can reach the outputs)."""
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
