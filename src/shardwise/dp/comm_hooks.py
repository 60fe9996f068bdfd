"""Communication hooks with torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

Shared by DDP and ZeRO stage 2 (both fill gradient buckets, grad_buckets.py), each holding one
:class:`CommHookSlot`. A registered hook replaces the wrapper's own reduction of every bucket
(DDP: the averaging all-reduce; ZeRO stage 2: the reduce-scatter to the owners, so a hook costs
stage 2 an all-reduce's traffic, of which the owner keeps its part). It gets a
:class:`GradBucket` (torch's ``dist.GradBucket`` interface: ``index()``, ``buffer()``,
``gradients()``, ``parameters()``, ``is_last()``, ``set_buffer()``) whose flat buffer holds
this rank's summed gradients, not yet divided by the world size (dividing is the hook's job, as
in torch), and returns a ``torch.futures.Future`` whose value is the reduced bucket: a tensor
of the buffer's shape (or a one-element list of it). The hook runs when the bucket is full,
during backward; DDP waits on the future when backward ends and copies its value into the
bucket unless it is the buffer itself. So torch's hooks in
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` run unchanged. One difference:
torch's DDP refuses ``bf16_compress_hook`` without CUDA and NCCL; ours runs it wherever the
process group can all-reduce bfloat16 (gloo on CPU can). A joined rank (join.py) runs the hook on
all-zero buckets, as torch's does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise._compat import FUTURE_TYPE
from shardwise.dp.buckets import Bucket

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One gradient bucket as a communication hook sees it (torch's ``dist.GradBucket``)."""

    def __init__(self, bucket: Bucket, is_last: bool):
        self._bucket = bucket
        self._buffer = bucket.allocate()  # 1D, the bucket's numel
        self._is_last = is_last

    def index(self) -> int:
        """Position of the bucket in reduction order (0 is reduced first)."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat 1D tensor of this rank's gradients, parameter after parameter."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: a view of :meth:`buffer` in the parameter's shape."""
        b = self._bucket
        return [self._buffer[o : o + p.numel()].view_as(p) for o, p in zip(b.offsets, b.params)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds, in buffer order."""
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in a backward pass."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the bucket's buffer (same shape): :meth:`buffer` returns it."""
        if not isinstance(tensor, torch.Tensor) or tensor.shape != self._buffer.shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"GradBucket.set_buffer needs a tensor of shape "
                             f"{tuple(self._buffer.shape)}, got {got}")
        self._buffer = tensor


class HookWork:
    """The pending result of a hook on one bucket; ``wait()`` lands it in the bucket."""

    def __init__(self, future: torch.futures.Future, bucket: Bucket, hook_name: str):
        self.future, self.bucket, self.hook_name = future, bucket, hook_name

    def wait(self) -> None:
        value = self.future.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        buffer = self.bucket.allocate()
        if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(
                type(value).__name__)
            raise RuntimeError(
                f"communication hook {self.hook_name} must return a Future whose value is the "
                f"reduced bucket, a tensor of shape {tuple(buffer.shape)}; bucket "
                f"{self.bucket.index}'s future gave {got}"
            )
        if value is not buffer:
            buffer.copy_(value)


def run_comm_hook(hook: CommHook, state: Any, bucket: Bucket, n_buckets: int) -> HookWork:
    """Call ``hook`` on ``bucket`` (launched during backward); checks that it gave a Future."""
    future = hook(state, GradBucket(bucket, bucket.index == n_buckets - 1))
    name = getattr(hook, "__qualname__", repr(hook))
    if not isinstance(future, FUTURE_TYPE):  # torch.futures.Future and what .then() gives
        raise TypeError(f"communication hook {name} must return a torch.futures.Future of the "
                        f"reduced bucket, got {type(future).__name__}")
    return HookWork(future, bucket, name)


class CommHookSlot:
    """At most one registered hook and its state, for one wrapper."""

    def __init__(self, owner: str):
        self.owner = owner
        self.hook: CommHook | None = None
        self.state: Any = None

    def register(self, state: Any, hook: CommHook) -> None:
        """Check and keep ``hook``; a second registration is an error, as in torch."""
        if self.hook is not None:
            raise RuntimeError(f"register_comm_hook can only be called once per {self.owner}; "
                               f"{getattr(self.hook, '__qualname__', self.hook)} is registered")
        check_comm_hook(hook)
        self.hook, self.state = hook, state

    def run(self, bucket: Bucket, n_buckets: int) -> HookWork:
        assert self.hook is not None, "no communication hook registered"
        return run_comm_hook(self.hook, self.state, bucket, n_buckets)


def check_comm_hook(hook: Any) -> None:
    """Reject what cannot be a hook: not callable, not ``(state, bucket)``, or annotated with
    other types than torch's ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``."""
    if not callable(hook):
        raise TypeError(f"communication hook must be callable, got {type(hook).__name__}")
    sig = inspect.signature(hook)
    try:
        sig.bind(None, None)
    except TypeError:
        raise TypeError(f"communication hook must take two arguments (state, bucket); "
                        f"{getattr(hook, '__qualname__', hook)} has signature {sig}") from None
    bucket = sig.parameters.get("bucket")
    annotation = bucket.annotation if bucket is not None else inspect.Parameter.empty
    if annotation not in (inspect.Parameter.empty, dist.GradBucket, GradBucket) and not \
            isinstance(annotation, str):
        raise ValueError("communication hook: the bucket annotation should be dist.GradBucket")
    ret = sig.return_annotation
    if ret not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]) and not \
            isinstance(ret, str):
        raise ValueError("communication hook: the return annotation should be "
                         "torch.futures.Future[torch.Tensor]")
