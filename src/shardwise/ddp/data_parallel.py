"""Our DistributedDataParallel, with the constructor of torch.nn.parallel.DistributedDataParallel.

At wrap time rank 0's parameters and buffers are broadcast (one coalesced broadcast per dtype),
so every replica starts equal. During backward, gradients are averaged across ranks by
all-reduces on size-capped buckets, launched asynchronously from gradient hooks while backward is
still running (see [Note: gradient buckets] in shardwise/distributed/grad_buckets.py). Inside
``no_sync()`` no collective runs and gradients accumulate locally; the first backward outside it
reduces the accumulated sum.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.collectives import broadcast_coalesced
from shardwise.distributed.grad_buckets import Bucket, GradBucketer

MIB = 1024 * 1024
FIRST_BUCKET_MB = 1.0


class DistributedDataParallel(nn.Module):
    """Data parallelism over ``process_group`` (default: the world group).

    Arguments keep torch's names. ``bucket_cap_mb`` caps each gradient bucket (default 25 MiB;
    the first bucket is capped at 1 MiB so that communication starts early).
    ``find_unused_parameters=True`` lets parameters go without a gradient in a step (they
    contribute zeros); without it such a parameter is an error that names it.
    ``gradient_as_bucket_view=True`` makes ``param.grad`` a view into the reduced bucket instead
    of a copy. ``static_graph`` and ``check_reduction`` are accepted for compatibility: buckets
    are already reduced in a fixed order, so no extra work is needed for a static graph.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ):
        super().__init__()
        _check_module(module, device_ids)
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        if init_sync:
            broadcast_coalesced(_state_tensors(module), 0, self.process_group)
        cap = int((25.0 if bucket_cap_mb is None else bucket_cap_mb) * MIB)
        first_cap = min(cap, int(FIRST_BUCKET_MB * MIB))
        self.reducer = GradBucketer(
            list(module.named_parameters()), cap, self._launch, self._finish,
            allow_unused=find_unused_parameters, first_cap_bytes=first_cap,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.world_size > 1:
            buffers = [b for b in self.module.buffers() if b.is_floating_point() or b.numel()]
            if buffers:
                broadcast_coalesced(buffers, 0, self.process_group)
        if self.device_ids:
            device = torch.device("cuda", _index(self.device_ids[0]))
            inputs, kwargs = _to_device(inputs, device), _to_device(kwargs, device)
        return self.module(*inputs, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        """Skip gradient reduction inside the block; gradients accumulate locally."""
        return self.reducer.paused()

    def _launch(self, bucket: Bucket) -> dist.Work | None:
        if self.world_size == 1:
            return None
        bucket.buffer.div_(self.world_size)
        return dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)

    def _finish(self, bucket: Bucket) -> None:
        for i, param in enumerate(bucket.params):
            reduced = bucket.slot(i)
            if self.gradient_as_bucket_view:
                param.grad = reduced
            elif param.grad is None:
                param.grad = reduced.clone()
            else:
                param.grad.copy_(reduced)


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in module.parameters()] + list(module.buffers())


def _check_module(module: nn.Module, device_ids: list | None) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    kinds = {p.device.type for p in module.parameters()}
    if len(kinds) > 1:
        raise ValueError(
            "DistributedDataParallel needs all parameters on one device type, "
            f"found {sorted(kinds)}"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("DistributedDataParallel: the module has no parameter that requires grad")
    if device_ids is not None and len(device_ids) != 1:
        raise ValueError(f"device_ids must name exactly one device per process, got {device_ids}")


def _index(device: int | torch.device) -> int:
    return device if isinstance(device, int) else (device.index or 0)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
