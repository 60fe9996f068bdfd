"""Gradient accumulation without communication: ``no_sync`` / ``set_requires_gradient_sync``.

While gradient sync is off, each unit keeps its unsharded flat gradient across backward passes
(autograd adds into it) and issues no reduce-scatter; the first backward with sync on again
reduce-scatters the accumulated sum, as torch's FSDP does. This costs the memory of unsharded
gradients while accumulating, and saves one reduce-scatter per unit per skipped micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from shardwise.fsdp.unit import units_of


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction of every unit at or below ``module`` on or off."""
    units = units_of(module)
    if not units:
        raise ValueError(f"{type(module).__name__} has no FSDP units: apply fully_shard first")
    for unit in units:
        unit.no_sync = not requires_gradient_sync


@contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Inside the block, backward accumulates unsharded gradients without communicating."""
    set_requires_gradient_sync(module, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(module, True)
