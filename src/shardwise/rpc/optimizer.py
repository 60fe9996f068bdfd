"""DistributedOptimizer: one local optimizer per owner of parameters, stepped by RPC.

The constructor groups the parameter RRefs by owner and creates, on each owner, a local
optimizer over the owner's own ``nn.Parameter`` objects (``rref.local_value()``, not copies).
``step(context_id)`` asks every owner, concurrently, to load that context's gradients into
``.grad``, step, and restore ``.grad``: the parameters change in place, so every module and
RRef that holds them sees the update.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from shardwise.rpc import api
from shardwise.rpc.current import get_agent
from shardwise.rpc.rrefs.rref import RRef
from shardwise.rpc.trust.callables import ForbiddenCallable, register, require_class


class _LocalOptimizer:
    def __init__(self, optimizer_class: type, param_rrefs: list[RRef], args: tuple,
                 kwargs: dict):
        self.params = [r.local_value() for r in param_rrefs]
        self.optim = optimizer_class(self.params, *args, **kwargs)
        self.lock = threading.Lock()

    def step(self, context_id: int) -> None:
        grads = get_agent().autograd.get(context_id).gradients()
        with self.lock:
            saved = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, g in zip(self.params, saved):
                    p.grad = g


_WHAT = "DistributedOptimizer's optimizer_class"


@register
def _new_local_optimizer(optimizer_class, param_rrefs, args, kwargs) -> _LocalOptimizer:
    """Runs on the owner of ``param_rrefs``. The class must be an optimizer class, checked
    before anything runs ([Note: allow-list] rule 5)."""
    require_class(optimizer_class, torch.optim.Optimizer, _WHAT)
    if not isinstance(param_rrefs, list) or not all(isinstance(r, RRef) for r in param_rrefs):
        raise ForbiddenCallable("DistributedOptimizer needs a list of parameter RRefs")
    return _LocalOptimizer(optimizer_class, param_rrefs, tuple(args), dict(kwargs))


@register
def _step_local(opt_rref: RRef, context_id: int) -> None:
    opt = opt_rref.local_value() if isinstance(opt_rref, RRef) else None
    if not isinstance(opt, _LocalOptimizer):
        raise ForbiddenCallable(f"DistributedOptimizer steps only the local optimizers it "
                                f"created; this RRef holds a {type(opt).__name__}")
    opt.step(context_id)


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` as in torch."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params_rref: list[RRef],
                 *args: Any, **kwargs: Any):
        require_class(optimizer_class, torch.optim.Optimizer, _WHAT)
        by_owner: dict[str, list[RRef]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner_name(), []).append(rref)
        self.remote_optimizers = [
            api.remote(owner, _new_local_optimizer,
                       args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in by_owner.items()
        ]
        for opt in self.remote_optimizers:  # surface construction errors here and now
            opt.local_value() if opt.is_owner() else opt._created.wait()

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id``; waits for all."""
        futs = [api.rpc_async(opt.owner(), _step_local, args=(opt, context_id))
                for opt in self.remote_optimizers]
        for fut in futs:
            fut.wait()
