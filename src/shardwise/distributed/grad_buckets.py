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

Sizes (:class:`BucketSizes`, the defaults of every wrapper that buckets): ``cap`` bytes per
bucket; a smaller first bucket so that the first collective starts early (torch's rule); and a
tail of small buckets: the parameters whose gradients come last in backward (the first
``tail_bytes`` in registration order) go in buckets of at most ``tail_cap`` bytes, so that what
is left to reduce when backward ends, the communication nothing overlaps, is one small bucket
rather than a full one.

``scale``: when set, every gradient is multiplied by it as it is copied into its bucket (one
pass: DDP's averaging by the world size, with no separate division of the bucket).

Sharded gradients (ZeRO stage 2; DDP leaves it ``None``) are one policy value,
:class:`ShardedGrads`: ``owner_of`` keeps parameters of different owning ranks in different
buckets, so one collective delivers a bucket to its owner; ``param.grad`` is dropped once
copied into its bucket; a bucket's buffer exists from its first gradient until ``finish``; and
once more than ``max_in_flight`` buckets are in flight the oldest is waited on and finished, so
reduced buckets are freed during backward, not at its end.

Options for torch's DDP semantics (DDP uses them; ZeRO stage 2 does not): ``unused_group``
makes "no gradient" a global question, as in torch: each rank marks which parameters got a
gradient since the last reduction (hooks fired, also inside ``paused()``), and one extra
all-reduce of that used-map over ``unused_group`` (after the last bucket's collective) tells
which parameters no rank used; ``finish`` sees them in ``bucket.unused`` and leaves their
``.grad`` alone (``None`` stays ``None``, so an optimizer skips them). A parameter some ranks
used gets the average with zeros from the others. ``set_static_graph()`` counts, in the first
reduction, how many times each parameter's hook fires (reentrant checkpointing fires it once per
use) and from then on treats a parameter as ready after that many firings; without it, a second
firing before the bucket's launch re-copies the accumulated gradient, and one after it is an
error (its new part could not be reduced).

[Note: reduction outside autograd's accumulation]
Distributed autograd (shardwise/rpc/autograd/engine.py) computes leaf gradients with
``torch.autograd.grad``, which never runs AccumulateGrad, so no hook above fires; as in torch,
those gradients live in the autograd context, not in ``.grad``. A bucketer made with
``detached=True`` registers its parameters here, and the engine hands every pass's leaf
gradients to :func:`reduce_detached_gradients` before storing them: the buckets are filled from
those gradients, reduced with the same launch function and order as in a normal backward, and the
reduced values (globally unused parameters left out) are returned in place of the local ones.
As in torch (whose reducer finalises at the end of each local engine run), one reduction covers
one local pass: a wrapped model's gradients should all come from the same pass, as in the
DDP + RPC pattern where the wrapped part sits between the trainer's remote inputs and its loss.
There is no overlap with backward on this path (the pass has ended), and, as for a normal
backward, one model must not be in two backward passes at once.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise._compat import queue_callback


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
    # each parameter's view of `buffer` (its shape), made with the buffer: a gradient hook and
    # the finish step use them every step, and slicing anew costs (docs/data_parallel.md)
    views: list[torch.Tensor] | None = field(default=None, repr=False)
    # positions of parameters that no rank used in this reduction (set before finish when
    # globally unused parameters are tracked; see the module docstring)
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
        """The buckets torch 2.13's DDP uses from its second step on (measured on CPU: it
        rebuilds them in gradient-ready order, each closed once it reaches ``bucket_cap_mb``,
        with no small first bucket) and no tail of small buckets: for communication hooks,
        whose cost per bucket (several collectives, compression) outweighs what a small
        bucket saves at either end of backward."""
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


@dataclass(frozen=True)
class ShardedGrads:
    """The policy for gradients kept by one owner per bucket (ZeRO stage 2; see the module
    docstring): ``owner_of(param)`` is the owning rank."""

    owner_of: Callable[[nn.Parameter], int]
    max_in_flight: int = 2


Launch = Callable[[Bucket], "Waitable | None"]
Finish = Callable[[Bucket], None]

# parameter -> weak reference to the bucketer that reduces its gradients when a backward engine
# hands them over without accumulating them (see [Note: reduction outside autograd's
# accumulation]); keyed by identity, dropped with the parameter
_DETACHED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_serials = itertools.count()


def reduce_detached_gradients(grads: Mapping[torch.Tensor, torch.Tensor]
                              ) -> dict[torch.Tensor, torch.Tensor]:
    """Leaf gradients of one backward pass, with those of bucketed parameters reduced.

    For a backward engine that does not accumulate into ``.grad`` (distributed autograd). Every
    bucketer made with ``detached=True`` that owns some of these leaves reduces them now (its
    collectives, in its bucket order; bucketers in creation order, the same on every rank) and
    its reduced gradients replace the local ones; a parameter that no rank used is left out.
    Tensors no bucketer owns pass through unchanged.
    """
    if not _DETACHED:
        return dict(grads)
    mine: dict[int, tuple[GradBucketer, dict]] = {}
    out: dict[torch.Tensor, torch.Tensor] = {}
    for tensor, grad in grads.items():
        ref = _DETACHED.get(tensor)
        owner = ref() if ref is not None else None
        if owner is None:
            out[tensor] = grad
        else:
            mine.setdefault(owner.serial, (owner, {}))[1][tensor] = grad
    for serial in sorted(mine):
        owner, owned = mine[serial]
        out.update(owner.reduce_detached(owned))
    return out


class GradBucketer:
    """Owns the buckets and hooks for a list of parameters; see [Note: gradient buckets]."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], sizes: BucketSizes,
                 launch: Launch, finish: Finish, *, allow_unused: bool = False,
                 sharded: ShardedGrads | None = None,
                 unused_group: dist.ProcessGroup | None = None, detached: bool = False):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.launch_fn, self.finish_fn, self.allow_unused = launch, finish, allow_unused
        self.release_grads = self.lazy_buffers = sharded is not None
        max_in_flight = sharded.max_in_flight if sharded is not None else None
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if max_in_flight is not None and unused_group is not None:
            raise ValueError("unused_group needs every bucket finished after the used-map "
                             "all-reduce; it cannot be combined with sharded gradients")
        self.max_in_flight = max_in_flight
        self.scale: float | None = None  # multiply gradients by it on their way into buckets
        self.unused_group = unused_group
        self._group_size = dist.get_world_size(unused_group) if unused_group is not None else 1
        self.enabled = True
        self.static = False
        self.reductions = 0  # completed reductions (backward passes that synchronised)
        # whether the reduction in progress came from reduce_detached (its gradients are not in
        # ``.grad``)
        self.detached_pass = False
        # seconds the last backward spent at its end launching, waiting for and finishing the
        # buckets: the communication that did not overlap backward's compute (benchmarks)
        self.last_finalize_s = 0.0
        self.serial = next(_serials)
        self._in_backward = False
        self._paused_used: set[nn.Parameter] = set()  # got a gradient inside paused()
        self._fired: dict[nn.Parameter, int] = {}  # static graph: hook firings this reduction
        self._expected: dict[nn.Parameter, int] | None = None  # static graph: learned firings
        self._static_unused: list[frozenset[int]] | None = None  # static graph: per bucket
        key_fn = sharded.owner_of if sharded is not None else None
        self._named = named
        self._keys = [(p.dtype, p.device, key_fn(p) if key_fn else None) for _, p in named]
        self._plan(sizes)
        self._handles = []
        for _, p in named:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            if detached:
                _DETACHED[p] = weakref.ref(self)
        self._next_launch = 0

    def _plan(self, sizes: BucketSizes) -> None:
        named = self._named
        plan = plan_buckets([p.numel() * p.element_size() for _, p in named], self._keys,
                            sizes.cap, sizes.first_cap, sizes.tail_bytes, sizes.tail_cap,
                            sizes.close_at_cap)
        self.buckets = [self._make_bucket(k, [named[i] for i in idx])
                        for k, idx in enumerate(plan)]
        if not self.lazy_buffers:
            for bucket in self.buckets:
                bucket.allocate()
        self._where: dict[nn.Parameter, tuple[Bucket, int]] = {
            p: (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}

    def replan(self, sizes: BucketSizes) -> None:
        """Group the parameters into buckets anew (new buffers); before the first reduction
        only, when no backward is in progress."""
        if self.reductions or self._in_backward:
            raise RuntimeError("buckets can only be re-planned before the first backward pass "
                               "that reduces gradients")
        self._plan(sizes)

    @staticmethod
    def _make_bucket(index: int, named: list[tuple[str, nn.Parameter]]) -> Bucket:
        offsets, total = [], 0
        for _, p in named:
            offsets.append(total)
            total += p.numel()
        return Bucket(index, [p for _, p in named], [n for n, _ in named], offsets, None,
                      total, [False] * len(named))

    @property
    def tracks_unused(self) -> bool:
        """Whether globally unused parameters are found by a used-map all-reduce in this
        reduction: with unused parameters allowed, or in a static graph's first reduction
        (later ones reuse what it found, as the graph does not change)."""
        if self.unused_group is None:
            return False
        return self.allow_unused or (self.static and self._static_unused is None)

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

    def set_static_graph(self) -> None:
        """Declare that every backward uses the same parameters the same number of times (see
        the module docstring). Allowed only before the first reduction."""
        if self.reductions:
            raise RuntimeError("the static graph must be set before the first backward pass "
                               "that reduces gradients, right after the wrapper is built")
        self.static = True

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._where:
            ref = _DETACHED.get(p)
            if ref is not None and ref() is self:
                del _DETACHED[p]

    # ------------------------------------------------------------ normal backward
    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            if self.unused_group is not None:
                self._paused_used.add(param)
            return
        if not self._in_backward:
            self._in_backward = True
            queue_callback(self._finalize)
        bucket, i = self._where[param]
        if self.static:
            if not self._static_ready(param, bucket, i):
                return
        elif bucket.ready[i] and bucket.state is not BucketState.FILLING:
            self._reset()
            raise RuntimeError(
                f"parameter {bucket.names[i]} received a second gradient in this backward pass "
                "after its bucket's reduction had started (a parameter used in several "
                "reentrant checkpointed segments, for example). If every backward pass uses the "
                "parameters the same way, construct DistributedDataParallel with "
                "static_graph=True (or call _set_static_graph() before training)."
            )
        bucket.allocate()
        if bucket.ready[i] and self.release_grads:  # the first part was released
            bucket.slot(i).add_(param.grad, alpha=self.scale or 1)
        else:
            self._copy_in(bucket, i, param.grad)  # a second firing: .grad holds the sum
        if self.release_grads:
            param.grad = None
        bucket.mark_ready(i)
        self._guarded(self._launch_in_order)

    def _copy_in(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        """Slot ``i`` of ``bucket`` = ``grad * scale + addend`` in one pass (``scale`` and the
        bucket's addend when set; ``grad`` None counts as zeros)."""
        slot, extra = bucket.slot(i), bucket.addend_slot(i)
        if grad is None:
            slot.copy_(extra) if extra is not None else slot.zero_()
        elif extra is not None:
            torch.add(extra, grad, alpha=1 if self.scale is None else self.scale, out=slot)
        elif self.scale is None:
            slot.copy_(grad)
        else:
            torch.mul(grad, self.scale, out=slot)

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run ``step``; if it raises (a failed collective, a bad hook result), forget this
        reduction so that the next backward starts clean, then re-raise."""
        try:
            step()
        except BaseException:
            self._reset()
            raise

    def _static_ready(self, param: nn.Parameter, bucket: Bucket, i: int) -> bool:
        """Count a firing; ready when it is the last one of the learned count."""
        fired = self._fired[param] = self._fired.get(param, 0) + 1
        if self._expected is None:
            return False  # first reduction: everything is copied when backward ends
        expected = self._expected.get(param, 0)
        if fired > expected:
            self._reset()
            raise RuntimeError(
                f"static graph: parameter {bucket.names[i]} received {fired} gradients in this "
                f"backward pass, {expected} in the first one; the graph is not static"
            )
        return fired == expected

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
            self._finish(bucket, self.finish_fn)

    def _finish(self, bucket: Bucket, finish: Finish) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        finish(bucket)
        bucket.state, bucket.work = BucketState.REDUCED, None
        if self.lazy_buffers:
            bucket.release()

    def _finalize(self) -> None:
        start = time.perf_counter()
        self._in_backward = False
        if self.static and self._expected is None:
            self._copy_fired()
        self._guarded(lambda: self._complete(self.finish_fn, from_grad_attr=True))
        self.last_finalize_s = time.perf_counter() - start

    def _copy_fired(self) -> None:
        """The first static reduction: copy every gradient that arrived, learn the counts."""
        for param in self._fired:
            bucket, i = self._where[param]
            bucket.allocate()
            self._copy_in(bucket, i, param.grad)
            if self.release_grads:
                param.grad = None
            bucket.mark_ready(i)
        self._expected = dict(self._fired)

    def _complete(self, finish: Finish, from_grad_attr: bool) -> None:
        """Fill in the unused, launch what is left, learn what no rank used, finish all."""
        local_used = self._local_used_map() if self.tracks_unused else None
        self._fill_unused(from_grad_attr)
        self._launch_in_order()
        unused = self._globally_unused(local_used) if local_used is not None else None
        if self.static and self.unused_group is not None:
            if self._static_unused is None:
                self._static_unused = unused
            unused = unused if self.allow_unused else self._static_unused
        for bucket in self.buckets:
            if bucket.state is BucketState.LAUNCHED:
                if unused is not None:
                    bucket.unused = unused[bucket.index]
                self._finish(bucket, finish)
            bucket.state = BucketState.FILLING
            bucket.clear_ready()
        self._next_launch = 0
        self._paused_used.clear()
        self._fired.clear()
        self.reductions += 1

    def _local_used_map(self) -> torch.Tensor:
        """1 for each parameter (in bucket order) that got a gradient since the last reduction."""
        paused = self._paused_used
        flags = [ok or p in paused or p in self._fired
                 for b in self.buckets for p, ok in zip(b.params, b.ready)]
        device = self.buckets[0].params[0].device
        return torch.tensor(flags, dtype=torch.int32, device=device)

    def _globally_unused(self, local_used: torch.Tensor) -> list[frozenset[int]]:
        """One all-reduce (sum) of the used-map; per bucket, the positions no rank used."""
        if self._group_size > 1:
            dist.all_reduce(local_used, group=self.unused_group)
        flags, out, start = local_used.tolist(), [], 0
        for bucket in self.buckets:
            n = len(bucket.params)
            out.append(frozenset(i for i in range(n) if not flags[start + i]))
            start += n
        return out

    def _fill_unused(self, from_grad_attr: bool) -> None:
        unused = [(b, i) for b in self.buckets for i, ok in enumerate(b.ready) if not ok]
        if not unused:
            return
        if not (self.allow_unused or self.static):
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
            self._copy_in(bucket, i, param.grad if from_grad_attr else None)
            if self.release_grads and from_grad_attr:
                param.grad = None
            bucket.mark_ready(i)

    def _reset(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                with suppress(Exception):  # already failing: do not hide the first error
                    bucket.work.wait()
            bucket.state, bucket.work = BucketState.FILLING, None
            bucket.clear_ready()
            if self.lazy_buffers:
                bucket.release()
        self._next_launch = 0
        self._in_backward = False
        self._paused_used.clear()
        self._fired.clear()

    # ------------------------------------------------------------ other engines, other ranks
    def reduce_detached(self, grads: Mapping[nn.Parameter, torch.Tensor]
                        ) -> dict[nn.Parameter, torch.Tensor]:
        """Reduce gradients handed over by an engine that does not write ``.grad`` (see
        [Note: reduction outside autograd's accumulation]); returns the reduced gradients of
        every parameter some rank used. Inside ``paused()`` they come back unchanged."""
        if not self.enabled:
            if self.unused_group is not None:
                self._paused_used.update(grads)
            return dict(grads)
        if self._in_backward:
            raise RuntimeError("gradients arrived from distributed autograd while a local "
                               "backward pass of the same model was still being reduced")
        for param, grad in grads.items():
            bucket, i = self._where[param]
            bucket.allocate()
            self._copy_in(bucket, i, grad)
            bucket.mark_ready(i)
        out: dict[nn.Parameter, torch.Tensor] = {}

        def collect(bucket: Bucket) -> None:
            for i, param in enumerate(bucket.params):
                if i not in bucket.unused:
                    out[param] = bucket.slot(i).clone()

        self.detached_pass = True
        try:
            self._guarded(lambda: self._complete(collect, from_grad_attr=False))
        finally:
            self.detached_pass = False
        return out

    def shadow_reduction(self) -> None:
        """Issue one reduction's collectives with all-zero gradients, finishing nothing.

        For a rank that has run out of inputs while the others still train (DDP's join): it
        must take part in their bucket collectives (and used-map all-reduce) in the same order,
        contributing zeros.
        """
        works = [self.launch_fn(bucket.zeros_like()) for bucket in self.buckets]
        if self.tracks_unused:
            used = torch.zeros(sum(len(b.params) for b in self.buckets), dtype=torch.int32,
                               device=self.buckets[0].params[0].device)
            unused = self._globally_unused(used)
            if self.static and self._static_unused is None:
                self._static_unused = unused  # as the training ranks learn it
        for work in works:
            if work is not None:
                work.wait()
