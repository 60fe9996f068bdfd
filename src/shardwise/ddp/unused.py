"""DDP's unused-parameter map: which parameters no rank used in a reduction.

``find_unused_parameters=True`` makes "this parameter got no gradient" a global question, as in
torch: each rank marks which parameters got a gradient since the last reduction (hooks fired,
also inside ``no_sync()``), and one extra all-reduce (sum) of that used-map over DDP's group,
issued after the last bucket's collective, tells which parameters no rank used. DDP's finish then
sees them in ``bucket.unused`` and leaves their ``.grad`` alone (``None`` stays ``None``, so an
optimizer skips them). A parameter some ranks used gets the average with zeros from the others.
With a static graph (static_graph.py) the map is computed in the first reduction only and
reused afterwards, since the graph does not change. ZeRO stage 2 (zero/stage2.py) finishes
buckets while others are still in flight, before the map is known, so it takes the globally
unused parameters once the reduction is over (``drop``) and sets their ``.grad`` back to None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dp.grad_buckets import BucketPolicy, GradBucketer


class UnusedMap(BucketPolicy):
    """The used-map all-reduce over ``group`` (see the module docstring). ``allow_unused``:
    ``find_unused_parameters``; ``static``: the graph is static (set before the first
    reduction); ``drop``: called with the parameters no rank used once a reduction is over, for
    a wrapper whose buckets may finish before the map is known."""

    def __init__(self, group: dist.ProcessGroup, allow_unused: bool,
                 drop: Callable[[list[nn.Parameter]], None] | None = None):
        self.group, self.allow_unused, self.drop = group, allow_unused, drop
        self._to_drop: list[nn.Parameter] = []
        self.static = False
        self._size = dist.get_world_size(group)
        self._used: set[nn.Parameter] = set()  # got a gradient outside a ready slot
        self._local: torch.Tensor | None = None
        self._static_unused: list[frozenset[int]] | None = None  # learned in the first one

    def attach(self, bucketer: GradBucketer) -> None:
        if bucketer.max_in_flight is not None and self.drop is None:
            raise ValueError("the unused-parameter map needs every bucket finished after its "
                             "all-reduce; it cannot be combined with buckets finished in flight")
        super().attach(bucketer)

    @property
    def tracking(self) -> bool:
        """Whether this reduction runs the used-map all-reduce: with unused parameters
        allowed, or in a static graph's first reduction."""
        return self.allow_unused or (self.static and self._static_unused is None)

    def on_grad(self, param: nn.Parameter, paused: bool) -> None:
        # a static graph's parameter may have fired without being ready yet
        if paused or self.static:
            self._used.add(param)

    def note_used(self, params: Iterable[nn.Parameter]) -> None:
        """Gradients that arrived inside ``no_sync()`` without a hook (distributed autograd)."""
        self._used.update(params)

    def before_fill(self) -> None:
        self._local = self._local_map() if self.tracking else None

    def after_launch(self) -> None:
        unused = self._globally_unused(self._local) if self._local is not None else None
        self._local = None
        if self.static:
            if self._static_unused is None:
                self._static_unused = unused
            unused = unused if self.allow_unused else self._static_unused
        if unused is not None:
            for bucket in self.bucketer.buckets:
                bucket.unused = unused[bucket.index]
            if self.drop is not None:
                self._to_drop = [b.params[i] for b in self.bucketer.buckets for i in b.unused]

    def end_reduction(self) -> None:
        self._used.clear()
        self._local = None
        to_drop, self._to_drop = self._to_drop, []
        if to_drop:
            self.drop(to_drop)

    def shadow(self) -> None:
        """A joined rank's matching used-map all-reduce: it used nothing (ddp/join.py)."""
        if not self.tracking:
            return
        buckets = self.bucketer.buckets
        used = torch.zeros(sum(len(b.params) for b in buckets), dtype=torch.int32,
                           device=buckets[0].params[0].device)
        unused = self._globally_unused(used)
        if self.static and self._static_unused is None:
            self._static_unused = unused  # as the training ranks learn it

    def _local_map(self) -> torch.Tensor:
        """1 for each parameter (in bucket order) that got a gradient since the last reduction."""
        used = self._used
        buckets = self.bucketer.buckets
        flags = [ok or p in used for b in buckets for p, ok in zip(b.params, b.ready)]
        return torch.tensor(flags, dtype=torch.int32, device=buckets[0].params[0].device)

    def _globally_unused(self, local_used: torch.Tensor) -> list[frozenset[int]]:
        """One all-reduce (sum) of the used-map; per bucket, the positions no rank used."""
        if self._size > 1:
            dist.all_reduce(local_used, group=self.group)
        flags, out, start = local_used.tolist(), [], 0
        for bucket in self.bucketer.buckets:
            n = len(bucket.params)
            out.append(frozenset(i for i in range(n) if not flags[start + i]))
            start += n
        return out
