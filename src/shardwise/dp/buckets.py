"""Gradient buckets: their layout, their sizes, and how parameters are grouped into them.

A bucket is a flat buffer holding the gradients of a few parameters back to back, reduced by one
collective; see [Note: gradient buckets] in grad_buckets.py for how buckets are filled and
launched during backward, and :class:`BucketSizes` for the sizes every wrapper uses.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

import torch
from torch import nn


class Waitable(Protocol):
    """What a launch function returns: a ``dist.Work`` or anything else with ``wait()``."""

    def wait(self) -> object: ...


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
    filled: int = 0  # how many of `ready` are True (a hook tests fullness in O(1))
    state: BucketState = BucketState.FILLING
    work: Waitable | None = None
    # each parameter's view of `buffer` (its shape), made once with the buffer: a gradient hook
    # and the finish step use them every step
    views: list[torch.Tensor] | None = field(default=None, repr=False)
    # positions of parameters whose gradients finish must leave alone (set by a policy before
    # finish; DDP's unused-parameter map, ddp/unused.py)
    unused: frozenset[int] = frozenset()
    # added to every gradient on its way into the buffer (flat, `numel`; PowerSGD's error
    # feedback, ddp/powersgd.py); None adds nothing
    addend: torch.Tensor | None = field(default=None, repr=False)

    def allocate(self) -> torch.Tensor:
        """The buffer, allocated if absent (padding zeroed; slots are written by copies)."""
        if self.buffer is None:
            first = self.params[0]
            self.allocate_into(torch.empty(self.numel, dtype=first.dtype, device=first.device))
        return self.buffer

    def adopt(self, buffer: torch.Tensor) -> None:
        """Use ``buffer`` (1D, ``numel`` elements; shared memory, for example) as the buffer."""
        if buffer.numel() != self.numel:
            raise ValueError(f"bucket {self.index} holds {self.numel} elements, the buffer "
                             f"{buffer.numel()}")
        self.allocate_into(buffer)

    def allocate_into(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        used = self.offsets[-1] + self.params[-1].numel()
        self.buffer[used:].zero_()
        self.views = [self.buffer[o : o + p.numel()].view_as(p)
                      for o, p in zip(self.offsets, self.params)]

    def release(self) -> None:
        """Drop the buffer (a lazy bucket between uses)."""
        self.buffer = self.views = None

    def slot(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s view of the buffer, in its shape."""
        assert self.views is not None, "bucket buffer not allocated"
        return self.views[i]

    def addend_slot(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s view of :attr:`addend`, in its shape (None without an addend)."""
        if self.addend is None:
            return None
        o, p = self.offsets[i], self.params[i]
        return self.addend[o : o + p.numel()].view_as(p)

    def is_full(self) -> bool:
        return self.filled == len(self.params)

    def mark_ready(self, i: int) -> None:
        if not self.ready[i]:
            self.ready[i] = True
            self.filled += 1

    def clear_ready(self) -> None:
        self.ready = [False] * len(self.params)
        self.filled = 0

    def zeros_like(self) -> Bucket:
        """A copy of this bucket (same parameters and layout) over a new all-zero buffer."""
        ghost = replace(self, buffer=None, views=None, ready=[True] * len(self.params),
                        filled=len(self.params), state=BucketState.FILLING, work=None,
                        addend=None)
        ghost.allocate().zero_()
        return ghost


MIB = 1024 * 1024


@dataclass(frozen=True)
class BucketSizes:
    """How big gradient buckets are, in bytes (see [Note: gradient buckets])."""

    cap: int
    first_cap: int | None = None
    tail_bytes: int = 0
    tail_cap: int | None = None
    close_at_cap: bool = False  # close a bucket once it reaches the cap (torch's rebuilt plan)

    @classmethod
    def default(cls, bucket_cap_mb: float | None = None) -> BucketSizes:
        """The wrappers' defaults: ``bucket_cap_mb`` (default 25) per bucket, the first at most
        1 MiB (torch's), and the last 25 MiB of parameters in buckets of at most 2 MiB."""
        cap = int((DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
        return cls(cap, min(cap, int(FIRST_CAP_MB * MIB)), int(DEFAULT_CAP_MB * MIB),
                   min(cap, int(TAIL_CAP_MB * MIB)))

    def for_hooks(self) -> BucketSizes:
        """The buckets torch's DDP uses from its second step on (rebuilt in gradient-ready
        order, each closed once it reaches ``bucket_cap_mb``, no small first bucket) and no
        tail of small buckets: for communication hooks, whose cost per bucket (several
        collectives, compression) outweighs what a small bucket saves at either end of
        backward."""
        return replace(self, first_cap=None, tail_bytes=0, tail_cap=None, close_at_cap=True)


DEFAULT_CAP_MB = 25.0
FIRST_CAP_MB = 1.0
TAIL_CAP_MB = 2.0


def plan_buckets(sizes: Sequence[int], keys: Sequence[object], cap_bytes: int,
                 first_cap_bytes: int | None = None, tail_bytes: int = 0,
                 tail_cap_bytes: int | None = None, close_at_cap: bool = False
                 ) -> list[list[int]]:
    """Group parameter indices into buckets, walking the parameters in reverse order.

    ``sizes`` are bytes, ``keys`` (dtype, device) must match within a bucket. A bucket is closed
    when adding the next parameter would pass its cap (the first bucket may have a smaller cap,
    so the first collective starts early; the parameters in the first ``tail_bytes`` of
    registration order, whose gradients come last, have ``tail_cap_bytes``, so that the last
    collective is small). A parameter larger than the cap gets a bucket alone. With
    ``close_at_cap`` a bucket is instead closed once it holds at least its cap (torch's rule),
    so it may pass the cap by one parameter.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    before = list(itertools.accumulate(sizes, initial=0))
    buckets: list[list[int]] = []
    # key -> (bucket, bytes, cap, in the tail)
    open_by_key: dict[object, tuple[list[int], int, int, bool]] = {}
    for i in reversed(range(len(sizes))):
        tail = bool(tail_cap_bytes) and before[i] < tail_bytes
        current, used, cap, opened_in_tail = open_by_key.get(keys[i], ([], 0, 0, tail))
        full = used >= cap if close_at_cap else used + sizes[i] > cap
        if current and (full or tail != opened_in_tail):
            current, used = [], 0
        if not current:
            cap = cap_bytes
            if first_cap_bytes and not buckets:
                cap = first_cap_bytes
            elif tail:
                cap = tail_cap_bytes  # type: ignore[assignment]
            buckets.append(current)
        current.append(i)
        open_by_key[keys[i]] = (current, used + sizes[i], cap, tail)
    return buckets
