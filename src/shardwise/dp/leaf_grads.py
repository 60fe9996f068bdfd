"""Where a backward engine that never writes ``.grad`` hands its leaf gradients to be reduced.

Distributed autograd (shardwise/rpc/autograd/engine.py) computes leaf gradients with
``torch.autograd.grad``, so no gradient hook fires; it passes every local pass's leaf gradients
to :func:`reduce_detached_gradients` before storing them. A data-parallel wrapper that reduces
such gradients (DDP's ``DetachedReduction``, see [Note: reduction outside autograd's
accumulation] in ddp/detached.py) registers its parameters here with :func:`register`. This
module only routes: it knows nothing of how they are reduced.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary


class LeafReducer(Protocol):
    """Reduces the gradients of the parameters it registered; ``serial`` orders reducers the
    same way on every rank (creation order)."""

    serial: int

    def reduce(self, grads: Mapping[torch.Tensor, torch.Tensor]
               ) -> dict[torch.Tensor, torch.Tensor]: ...


# parameter -> weak reference to its reducer; keyed by identity, dropped with the parameter
_REDUCERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(params: Iterable[torch.Tensor], reducer: LeafReducer) -> None:
    """Route the gradients of ``params`` to ``reducer`` (held weakly)."""
    ref = weakref.ref(reducer)
    for p in params:
        _REDUCERS[p] = ref


def unregister(params: Iterable[torch.Tensor], reducer: LeafReducer) -> None:
    """Stop routing ``params`` to ``reducer`` (those routed elsewhere are left alone)."""
    for p in params:
        ref = _REDUCERS.get(p)
        if ref is not None and ref() is reducer:
            del _REDUCERS[p]


def reduce_detached_gradients(grads: Mapping[torch.Tensor, torch.Tensor]
                              ) -> dict[torch.Tensor, torch.Tensor]:
    """Leaf gradients of one backward pass, with those of registered parameters reduced.

    Every reducer that owns some of these leaves reduces them now (reducers in ``serial``
    order, the same on every rank, each issuing its collectives in its own order) and its
    result replaces the local gradients (a parameter it leaves out is dropped). Tensors no
    reducer owns pass through unchanged.
    """
    if not _REDUCERS:
        return dict(grads)
    mine: dict[int, tuple[LeafReducer, dict]] = {}
    out: dict[torch.Tensor, torch.Tensor] = {}
    for tensor, grad in grads.items():
        ref = _REDUCERS.get(tensor)
        owner = ref() if ref is not None else None
        if owner is None:
            out[tensor] = grad
        else:
            mine.setdefault(owner.serial, (owner, {}))[1][tensor] = grad
    for serial in sorted(mine):
        owner, owned = mine[serial]
        out.update(owner.reduce(owned))
    return out
