"""Gradient buckets filled during backward, each reduced as soon as it is full.

[Note: gradient buckets]
Data parallelism must combine every rank's gradients. Doing it after backward wastes the time
backward spends on earlier layers; doing it per tensor pays one collective's latency per
parameter. So parameters are grouped into buckets of about ``cap_bytes`` (in reverse registration
order, the order in which backward usually produces their gradients; buckets.py). A hook that
runs after a parameter's gradient is accumulated copies it into its bucket's flat buffer; when a
bucket is complete, a caller-supplied collective is launched on it asynchronously while backward
goes on. DDP launches an all-reduce (ddp/paths.py), ZeRO stage 2 a reduce-scatter to the
parameters' owners (zero/stage2.py). Buckets are launched strictly in index order, so every rank
issues the same collectives in the same order even when gradients become ready in a different
order. At the end of backward (an autograd engine callback) the remaining buckets are launched,
all are waited on, and a caller-supplied ``finish`` consumes each reduced bucket. A parameter
that got no gradient is an error naming it, unless unused parameters are allowed, in which case
it contributes zeros.

``scale``: when set, every gradient is multiplied by it as it is copied into its bucket (one
pass: DDP's averaging by the world size, with no separate division of the bucket).

How gradients are held is one value, :class:`Holding`: by default ``.grad`` keeps its gradient
and every bucket's buffer lives as long as the bucketer. A sharding wrapper (ZeRO stage 2,
zero/stage2.py) instead drops ``param.grad`` once copied, gives a bucket its buffer only from its
first gradient until ``finish``, lays out each bucket by a key (the owning rank), and finishes
the oldest bucket once more than ``max_in_flight`` are in flight, so reduced buckets are freed
during backward, not at its end.

A mechanism's own rules plug in as :class:`BucketPolicy` objects, told of every gradient hook
firing and of each stage of a reduction. DDP's are in ddp/: the static graph (a parameter ready
after a learned number of firings), the unused-parameter map (one more all-reduce telling which
parameters no rank used), the reduction of gradients from distributed autograd, and the join
shadow. This module knows none of them.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import torch
from torch import nn

from shardwise._compat import backward_running, queue_callback
from shardwise.dp.buckets import Bucket, BucketSizes, BucketState, Waitable, plan_buckets

Launch = Callable[[Bucket], "Waitable | None"]
Finish = Callable[[Bucket], None]

_serials = itertools.count()


@dataclass(frozen=True)
class Holding:
    """How a bucketer holds gradients (see the module docstring). The default keeps ``.grad``
    and allocates every bucket's buffer once."""

    release_grads: bool = False  # drop ``param.grad`` once copied into its bucket
    lazy_buffers: bool = False  # a buffer exists from a bucket's first gradient until finish
    max_in_flight: int | None = None  # finish the oldest launched bucket beyond this many
    # a parameter's place in a bucket's layout: parameters of one bucket are laid out sorted
    # by it (stable), so those of equal key are contiguous; None keeps reverse registration order
    layout_key: Callable[[nn.Parameter], int] | None = None
    # a lazy bucket's buffer, when it needs one: a tensor of the bucket's numel to adopt (shared
    # memory its collective reads, say), or None for a private allocation
    buffer_for: Callable[[Bucket], torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")


class BucketPolicy:
    """A mechanism's rule plugged into a :class:`GradBucketer`; each method does nothing by
    default. Policies are called in the order they were added."""

    # a parameter without a gradient at the end of a reduction contributes zeros (no error)
    allows_missing = False

    def attach(self, bucketer: GradBucketer) -> None:
        """Called once, when the policy is added."""
        self.bucketer = bucketer

    def on_grad(self, param: nn.Parameter, paused: bool) -> None:
        """Every firing of a parameter's gradient hook (``paused``: inside ``paused()``)."""

    def admit(self, param: nn.Parameter, bucket: Bucket, i: int) -> bool | None:
        """Whether this firing makes the parameter ready: True (copy it now), False (not yet),
        None (the core's rule: ready now, and a firing after its bucket was launched is an
        error). May raise; the reduction is then forgotten."""
        return None

    def end_of_backward(self) -> None:
        """A backward pass has ended, before its reduction is completed."""

    def before_fill(self) -> None:
        """A reduction is completing: before parameters without a gradient are filled in."""

    def after_launch(self) -> None:
        """Every bucket of the reduction has been launched; nothing is finished yet unless
        :class:`Holding` bounds the buckets in flight. May set each bucket's ``unused``."""

    def end_reduction(self) -> None:
        """The reduction is over (completed or forgotten after an error)."""


class GradBucketer:
    """Owns the buckets and hooks for a list of parameters; see [Note: gradient buckets]."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], sizes: BucketSizes,
                 launch: Launch, finish: Finish, *, allow_unused: bool = False,
                 holding: Holding | None = None, wrapper: str = "the wrapper",
                 second_grad_hint: str = ""):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.launch_fn, self.finish_fn, self.allow_unused = launch, finish, allow_unused
        self.holding = holding or Holding()
        self.release_grads = self.holding.release_grads
        self.lazy_buffers = self.holding.lazy_buffers
        self.max_in_flight = self.holding.max_in_flight
        self.wrapper, self.second_grad_hint = wrapper, second_grad_hint
        self.scale: float | None = None  # multiply gradients by it on their way into buckets
        self.enabled = True
        self.reductions = 0  # completed reductions (backward passes that synchronised)
        # seconds the last backward spent at its end launching, waiting for and finishing the
        # buckets: the communication that did not overlap backward's compute (benchmarks)
        self.last_finalize_s = 0.0
        self.serial = next(_serials)  # creation order, the same on every rank
        self.policies: list[BucketPolicy] = []
        self._watchers: list[BucketPolicy] = []
        self._admitters: list[BucketPolicy] = []
        self._in_backward = False
        self._named = named
        self._keys = [(p.dtype, p.device) for _, p in named]
        self._plan(sizes)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self._next_launch = 0

    def add_policy(self, policy: BucketPolicy) -> None:
        """Plug in a rule (see :class:`BucketPolicy`); before the first reduction only."""
        if self.reductions or self._in_backward:
            raise RuntimeError("a bucket policy must be added before the first backward pass "
                               "that reduces gradients")
        policy.attach(self)
        self.policies.append(policy)
        # the per-firing calls go only to the policies that define them (they run per gradient)
        self._watchers = [p for p in self.policies if _defines(p, "on_grad")]
        self._admitters = [p for p in self.policies if _defines(p, "admit")]

    def _plan(self, sizes: BucketSizes) -> None:
        named = self._named
        plan = plan_buckets([p.numel() * p.element_size() for _, p in named], self._keys,
                            sizes.cap, sizes.first_cap, sizes.tail_bytes, sizes.tail_cap,
                            sizes.close_at_cap)
        order = self.holding.layout_key
        if order is not None:
            plan = [sorted(idx, key=lambda i: order(named[i][1])) for idx in plan]
        self.buckets = [_make_bucket(k, [named[i] for i in idx]) for k, idx in enumerate(plan)]
        if not self.lazy_buffers:
            for bucket in self.buckets:
                bucket.allocate()
        # keyed by id(): a tensor's __hash__ is a Python call, and this runs per gradient (the
        # buckets hold the parameters, so their ids stay theirs)
        self._where: dict[int, tuple[Bucket, int]] = {
            id(p): (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}

    def replan(self, sizes: BucketSizes) -> None:
        """Group the parameters into buckets anew (new buffers); before the first reduction
        only, when no backward is in progress."""
        if self.reductions or self._in_backward:
            raise RuntimeError("buckets can only be re-planned before the first backward pass "
                               "that reduces gradients")
        self._plan(sizes)

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass's reduction is in progress (begun, not yet completed)."""
        return self._in_backward

    def owns(self, param: nn.Parameter) -> bool:
        return id(param) in self._where

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

    # ------------------------------------------------------------ filling
    def _on_grad(self, param: nn.Parameter) -> None:
        for policy in self._watchers:
            policy.on_grad(param, not self.enabled)
        if not self.enabled:
            return
        if not self._in_backward:
            self._in_backward = True
            queue_callback(self._finalize)
        bucket, i = self._where[id(param)]
        # the core's rule alone admits a first firing: ask only when a policy or a repeat may say no
        if self._admitters or bucket.ready[i]:
            try:
                ready = self._admit(param, bucket, i)
            except BaseException:
                self._reset()
                raise
            if not ready:
                return
        if bucket.buffer is None:
            self._allocate(bucket)
        if bucket.ready[i] and self.release_grads:  # the first part was released
            bucket.slot(i).add_(param.grad, alpha=self.scale or 1)
        else:
            self._copy_in(bucket, i, param.grad)  # a second firing: .grad holds the sum
        if self.release_grads:
            param.grad = None
        bucket.mark_ready(i)
        upcoming = self._next_launch  # only the next bucket in order can launch now
        if upcoming < len(self.buckets) and self.buckets[upcoming].is_full():
            self._guarded(self._launch_in_order)

    def _admit(self, param: nn.Parameter, bucket: Bucket, i: int) -> bool:
        for policy in self._admitters:
            verdict = policy.admit(param, bucket, i)
            if verdict is not None:
                return verdict
        if bucket.ready[i] and bucket.state is not BucketState.FILLING:
            raise RuntimeError(
                f"parameter {bucket.names[i]} received a second gradient in this backward pass "
                "after its bucket's reduction had started (a parameter used in several "
                f"reentrant checkpointed segments, for example).{self.second_grad_hint}"
            )
        return True

    def fill(self, param: nn.Parameter, grad: torch.Tensor | None,
             release: bool = False) -> None:
        """Copy ``grad`` (None: zeros) into ``param``'s slot, scaled, and mark it ready;
        ``release``: drop ``param.grad`` afterwards when this bucketer releases gradients."""
        bucket, i = self._where[id(param)]
        self._allocate(bucket)
        self._copy_in(bucket, i, grad)
        if release and self.release_grads:
            param.grad = None
        bucket.mark_ready(i)

    def _allocate(self, bucket: Bucket) -> None:
        if bucket.buffer is None and self.holding.buffer_for is not None:
            given = self.holding.buffer_for(bucket)
            if given is not None:
                bucket.adopt(given)
        bucket.allocate()

    def _copy_in(self, bucket: Bucket, i: int, grad: torch.Tensor | None) -> None:
        """Slot ``i`` of ``bucket`` = ``grad * scale + addend`` in one pass (``scale`` and the
        bucket's addend when set; ``grad`` None counts as zeros)."""
        slot = bucket.slot(i)
        extra = None if bucket.addend is None else bucket.addend_slot(i)
        if grad is None:
            slot.copy_(extra) if extra is not None else slot.zero_()
        elif extra is not None:
            torch.add(extra, grad, alpha=1 if self.scale is None else self.scale, out=slot)
        elif self.scale is None:
            slot.copy_(grad)
        else:
            torch.mul(grad, self.scale, out=slot)

    def _guarded(self, step: Callable[[], object]) -> object:
        """Run ``step``; if it raises (a failed collective, a bad hook result, a policy's
        refusal), forget this reduction so that the next backward starts clean, then re-raise."""
        try:
            return step()
        except BaseException:
            self._reset()
            raise

    def end_abandoned_backward(self) -> None:
        """Call before a forward. A backward pass that raised never ran its queued callback
        (``_finalize``), so its buckets still hold that pass's gradients and flags, and the
        next backward would find parameters already in: forget that reduction, after waiting
        for the buckets it launched (every rank launched the same ones when every rank raised
        at the same point), and warn. The gradients it had not reduced are dropped, as FSDP
        drops them ([Note: a backward that raised] in fsdp/root.py)."""
        if self._in_backward and not backward_running():
            warnings.warn(f"{self.wrapper}: the previous backward pass raised before it ended; "
                          "the gradients it had not reduced yet are dropped", stacklevel=3)
            self._reset()

    # ------------------------------------------------------------ launching and finishing
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
        self._guarded(self._end_of_backward)
        self.complete(self.finish_fn, from_grad_attr=True)
        self.last_finalize_s = time.perf_counter() - start

    def _end_of_backward(self) -> None:
        for policy in self.policies:
            policy.end_of_backward()

    def complete(self, finish: Finish, from_grad_attr: bool) -> None:
        """Fill in the parameters without a gradient (from ``.grad`` when ``from_grad_attr``,
        else zeros), launch what is left, finish every bucket with ``finish``. On an error the
        reduction is forgotten and the error re-raised."""
        self._guarded(lambda: self._complete(finish, from_grad_attr))

    def _complete(self, finish: Finish, from_grad_attr: bool) -> None:
        for policy in self.policies:
            policy.before_fill()
        self._fill_missing(from_grad_attr)
        self._launch_in_order()
        for policy in self.policies:
            policy.after_launch()
        for bucket in self.buckets:
            if bucket.state is BucketState.LAUNCHED:
                self._finish(bucket, finish)
            bucket.state = BucketState.FILLING
            bucket.clear_ready()
        self._next_launch = 0
        for policy in self.policies:
            policy.end_reduction()
        self.reductions += 1

    def _fill_missing(self, from_grad_attr: bool) -> None:
        missing = [(b, i) for b in self.buckets for i, ok in enumerate(b.ready) if not ok]
        if not missing:
            return
        if not (self.allow_unused or any(p.allows_missing for p in self.policies)):
            names = [b.names[i] for b, i in missing]
            raise RuntimeError(
                f"these parameters received no gradient in this backward pass: {names}. "
                f"If parts of the model are unused in some steps, construct {self.wrapper} "
                "with find_unused_parameters=True; if they are never used, set "
                "requires_grad=False on them."
            )
        for bucket, i in missing:
            param = bucket.params[i]
            self.fill(param, param.grad if from_grad_attr else None, release=from_grad_attr)

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
        for policy in self.policies:
            policy.end_reduction()


def _make_bucket(index: int, named: list[tuple[str, nn.Parameter]]) -> Bucket:
    offsets, total = [], 0
    for _, p in named:
        offsets.append(total)
        total += p.numel()
    return Bucket(index, [p for _, p in named], [n for n, _ in named], offsets, None, total,
                  [False] * len(named))


def _defines(policy: BucketPolicy, method: str) -> bool:
    return getattr(type(policy), method) is not getattr(BucketPolicy, method)
