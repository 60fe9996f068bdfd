"""DDP's reduction of gradients that never reach ``.grad`` (distributed autograd).

[Note: reduction outside autograd's accumulation]
Distributed autograd (shardwise/rpc/autograd/engine.py) computes leaf gradients with
``torch.autograd.grad``, which never runs AccumulateGrad, so no gradient hook fires; as in torch,
those gradients live in the autograd context, not in ``.grad``. DDP registers its parameters with
the core's router (dp/leaf_grads.py), and the engine hands every pass's leaf gradients to
``reduce_detached_gradients`` before storing them: DDP's buckets are filled from those
gradients, reduced with the same launch function and order as in a normal backward, and the
reduced values (globally unused parameters left out) are returned in place of the local ones. As
in torch (whose reducer finalises at the end of each local engine run), one reduction covers one
local pass: a wrapped model's gradients should all come from the same pass, as in the DDP + RPC
pattern where the wrapped part sits between the trainer's remote inputs and its loss. There is no
overlap with backward on this path (the pass has ended), and, as for a normal backward, one model
must not be in two backward passes at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.ddp.unused import UnusedMap
from shardwise.dp import leaf_grads
from shardwise.dp.buckets import Bucket
from shardwise.dp.grad_buckets import GradBucketer


class DetachedReduction:
    """Reduces one DDP's gradients handed over by distributed autograd (see the Note)."""

    def __init__(self, bucketer: GradBucketer, unused: UnusedMap | None):
        self.bucketer, self.unused = bucketer, unused
        self.serial = bucketer.serial
        self.active = False  # a reduction from here is in progress (its grads are not in .grad)
        self._params = [p for b in bucketer.buckets for p in b.params]
        leaf_grads.register(self._params, self)

    def close(self) -> None:
        leaf_grads.unregister(self._params, self)

    def reduce(self, grads: Mapping[torch.Tensor, torch.Tensor]
               ) -> dict[torch.Tensor, torch.Tensor]:
        """The reduced gradients of every parameter some rank used. Inside ``no_sync()``
        they come back unchanged."""
        bucketer = self.bucketer
        if not bucketer.enabled:
            if self.unused is not None:
                self.unused.note_used(grads)
            return dict(grads)
        if bucketer.in_backward:
            raise RuntimeError("gradients arrived from distributed autograd while a local "
                               "backward pass of the same model was still being reduced")
        for param, grad in grads.items():
            bucketer.fill(param, grad)
        out: dict[nn.Parameter, torch.Tensor] = {}

        def collect(bucket: Bucket) -> None:
            for i, param in enumerate(bucket.params):
                if i not in bucket.unused:
                    out[param] = bucket.slot(i).clone()

        self.active = True
        try:
            bucketer.complete(collect, from_grad_attr=False)
        finally:
            self.active = False
        return out
