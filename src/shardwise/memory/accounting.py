"""Counting the bytes of model state this rank holds: parameters, gradients, optimizer state.

Process peaks (RSS) are blurred by the allocator keeping freed blocks; counting tensors is exact
and shows sharding directly. Each storage is counted once, so tied weights and views into one
flat buffer are not double-counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise._compat import storage_id


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_mib(self) -> dict[str, float]:
        mib = 1024.0 * 1024.0
        return {"params": self.params / mib, "grads": self.grads / mib,
                "optimizer": self.optimizer / mib, "total": self.total / mib}


def state_bytes(
    params: nn.Module | Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
) -> StateBytes:
    """Bytes this rank holds in ``params`` (a module or tensors), their ``.grad`` and the
    optimizer's state tensors, plus the ``.grad`` of the tensors the optimizer steps (ZeRO's
    element partition keeps reduced gradients on its slices of the parameters, not on the
    parameters). No collective: each rank reports its own."""
    tensors = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    grads = [p.grad for p in tensors if p.grad is not None]
    opt_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        opt_tensors = _optimizer_tensors(optimizer)
        grads += [p.grad for p in _stepped(optimizer) if p.grad is not None]
    return StateBytes(_unique_bytes(tensors), _unique_bytes(grads), _unique_bytes(opt_tensors))


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # Wrappers such as ZeroRedundancyOptimizer hold their local optimizer in `.optim`.
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer (or the local optimizer a wrapper holds in ``.optim``) steps."""
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    return [p for group in optimizer.param_groups for p in group["params"]]


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each byte once: the union of the ranges the
    tensors span (views of one storage that overlap count once; views of separate parts of
    one storage, such as a rank's rows in FSDP's host-shared parameters, count only those
    parts)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor counts its local shard
        if t.device.type == "meta" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        start = t.storage_offset() * t.element_size()
        end = start + _span_elements(t) * t.element_size()
        spans.setdefault(_storage_key(t, storage), []).append((start, end))
    return sum(_union_length(ranges) for ranges in spans.values())


def _union_length(ranges: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, end in sorted(ranges):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _storage_key(t: torch.Tensor, storage: torch.UntypedStorage) -> int:
    """What identifies ``t``'s storage: its data pointer; a fake tensor (a dry run's, see
    [Note: simulated ranks] in shardwise/sim/fake_group.py) has none, so its storage object."""
    if hasattr(t, "fake_mode"):
        return storage_id(storage)
    return storage.data_ptr()


def _span_elements(t: torch.Tensor) -> int:
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
