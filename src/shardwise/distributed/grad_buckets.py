"""Gradient buckets filled during backward, each reduced as soon as it is full.

[Note: gradient buckets]
Data parallelism must combine every rank's gradients. Doing it after backward wastes the time
backward spends on earlier layers; doing it per tensor pays one collective's latency per
parameter. So parameters are grouped into buckets of about ``cap_bytes`` (in reverse registration
order, the order in which backward usually produces their gradients). A hook that runs after a
parameter's gradient is accumulated copies it into its bucket's flat buffer; when a bucket is
complete, a caller-supplied collective is launched on it asynchronously while backward goes on.
DDP launches an all-reduce, ZeRO stage 2 a reduce-scatter. Buckets are launched strictly in
index order, so every rank issues the same collectives in the same order even when gradients
become ready in a different order. At the end of backward (an autograd engine callback) the
remaining buckets are launched, all are waited on, and a caller-supplied ``finish`` consumes each
reduced bucket. A parameter that got no gradient is an error naming it, unless unused parameters
are allowed, in which case it contributes zeros.

Options for sharded gradients (ZeRO stage 2; DDP uses none of them): ``key_fn`` keeps
parameters with different keys (their owning rank) in different buckets, so one collective
delivers a bucket to its owner; ``release_grads`` drops ``param.grad`` once it is copied into its
bucket; ``lazy_buffers`` allocates a bucket's buffer when its first gradient arrives and drops it
after ``finish``; ``max_in_flight`` waits on and finishes the oldest launched bucket as soon as
more than that many are in flight, so reduced buckets are freed during backward, not at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn


class BucketState(Enum):
    FILLING = "filling"  # waiting for gradients
    LAUNCHED = "launched"  # its collective is in flight
    REDUCED = "reduced"  # collective done, consumed by finish


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]  # element offset of each parameter in `buffer`
    buffer: torch.Tensor | None  # 1D, `numel`; None while a lazy bucket is not in use
    numel: int = 0  # sum of the parameters' numel (+ padding if asked)
    ready: list[bool] = field(default_factory=list)
    state: BucketState = BucketState.FILLING
    work: dist.Work | None = None
    # each parameter's view of `buffer` (its shape), made with the buffer: a gradient hook and
    # the finish step use them every step, and slicing anew cost ~20 us each on CPU
    views: list[torch.Tensor] | None = field(default=None, repr=False)

    def allocate(self) -> torch.Tensor:
        """The buffer, allocated if absent (padding zeroed; slots are written by copies)."""
        if self.buffer is None:
            first = self.params[0]
            self.buffer = torch.empty(self.numel, dtype=first.dtype, device=first.device)
            used = self.offsets[-1] + self.params[-1].numel()
            self.buffer[used:].zero_()
            self.views = [self.buffer[o : o + p.numel()].view_as(p)
                          for o, p in zip(self.offsets, self.params)]
        return self.buffer

    def release(self) -> None:
        """Drop the buffer (a lazy bucket between uses)."""
        self.buffer = self.views = None

    def slot(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s view of the buffer, in its shape."""
        assert self.views is not None, "bucket buffer not allocated"
        return self.views[i]

    def is_full(self) -> bool:
        return all(self.ready)


def plan_buckets(sizes: Sequence[int], keys: Sequence[object], cap_bytes: int,
                 first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets, walking the parameters in reverse order.

    ``sizes`` are bytes, ``keys`` (dtype, device) must match within a bucket. A bucket is closed
    when adding the next parameter would pass its cap (the first bucket may have a smaller cap,
    so the first collective starts early). A parameter larger than the cap gets a bucket alone.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[list[int]] = []
    open_by_key: dict[object, tuple[list[int], int, int]] = {}  # key -> (bucket, bytes, cap)
    for i in reversed(range(len(sizes))):
        current, used, cap = open_by_key.get(keys[i], ([], 0, 0))
        if current and used + sizes[i] > cap:
            current, used = [], 0
        if not current:
            cap = first_cap_bytes if (first_cap_bytes and not buckets) else cap_bytes
            buckets.append(current)
        current.append(i)
        open_by_key[keys[i]] = (current, used + sizes[i], cap)
    return buckets


Launch = Callable[[Bucket], "dist.Work | None"]
Finish = Callable[[Bucket], None]


class GradBucketer:
    """Owns the buckets and hooks for a list of parameters; see [Note: gradient buckets]."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], cap_bytes: int,
                 launch: Launch, finish: Finish, *, allow_unused: bool = False,
                 first_cap_bytes: int | None = None, pad_to_multiple: int = 1,
                 key_fn: Callable[[nn.Parameter], object] | None = None,
                 release_grads: bool = False, lazy_buffers: bool = False,
                 max_in_flight: int | None = None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.launch_fn, self.finish_fn, self.allow_unused = launch, finish, allow_unused
        self.release_grads, self.lazy_buffers = release_grads, lazy_buffers
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.enabled = True
        self._in_backward = False
        keys = [(p.dtype, p.device, key_fn(p) if key_fn else None) for _, p in named]
        plan = plan_buckets([p.numel() * p.element_size() for _, p in named], keys, cap_bytes,
                            first_cap_bytes)
        self.buckets = [self._make_bucket(k, [named[i] for i in idx], pad_to_multiple)
                        for k, idx in enumerate(plan)]
        if not lazy_buffers:
            for bucket in self.buckets:
                bucket.allocate()
        self._where: dict[nn.Parameter, tuple[Bucket, int]] = {}
        self._handles = []
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[p] = (bucket, i)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._next_launch = 0

    @staticmethod
    def _make_bucket(index: int, named: list[tuple[str, nn.Parameter]], pad: int) -> Bucket:
        offsets, total = [], 0
        for _, p in named:
            offsets.append(total)
            total += p.numel()
        total += (-total) % pad
        return Bucket(index, [p for _, p in named], [n for n, _ in named], offsets, None,
                      total, [False] * len(named))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Gradients produced inside the block stay in ``param.grad`` and are not bucketed or
        reduced (``no_sync`` of the wrappers that use this bucketer)."""
        previous = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = previous

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        bucket, i = self._where[param]
        if bucket.state is not BucketState.FILLING or bucket.ready[i]:
            return  # already launched (e.g. a parameter reached twice through reentrant code)
        bucket.allocate()
        bucket.slot(i).copy_(param.grad)
        if self.release_grads:
            param.grad = None
        bucket.ready[i] = True
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not bucket.is_full():
                return
            bucket.work = self.launch_fn(bucket)
            bucket.state = BucketState.LAUNCHED
            self._next_launch += 1
            if self.max_in_flight is not None:
                self._finish_oldest_beyond(self.max_in_flight)

    def _finish_oldest_beyond(self, limit: int) -> None:
        launched = [b for b in self.buckets[: self._next_launch]
                    if b.state is BucketState.LAUNCHED]
        for bucket in launched[: max(0, len(launched) - limit)]:
            self._finish(bucket)

    def _finish(self, bucket: Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        self.finish_fn(bucket)
        bucket.state, bucket.work = BucketState.REDUCED, None
        if self.lazy_buffers:
            bucket.release()

    def _finalize(self) -> None:
        self._in_backward = False
        self._fill_unused()
        self._launch_in_order()
        for bucket in self.buckets:
            if bucket.state is BucketState.LAUNCHED:
                self._finish(bucket)
            bucket.state = BucketState.FILLING
            bucket.ready = [False] * len(bucket.params)
        self._next_launch = 0

    def _fill_unused(self) -> None:
        unused = [(b, i) for b in self.buckets for i, ok in enumerate(b.ready) if not ok]
        if not unused:
            return
        if not self.allow_unused:
            self._reset()
            names = [b.names[i] for b, i in unused]
            raise RuntimeError(
                f"these parameters received no gradient in this backward pass: {names}. "
                "If parts of the model are unused in some steps, construct "
                "DistributedDataParallel with find_unused_parameters=True; if they are never "
                "used, set requires_grad=False on them."
            )
        for bucket, i in unused:
            param = bucket.params[i]
            bucket.allocate()
            slot = bucket.slot(i)
            slot.copy_(param.grad) if param.grad is not None else slot.zero_()
            if self.release_grads:
                param.grad = None
            bucket.ready[i] = True

    def _reset(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.state, bucket.work = BucketState.FILLING, None
            bucket.ready = [False] * len(bucket.params)
            if self.lazy_buffers:
                bucket.release()
        self._next_launch = 0
