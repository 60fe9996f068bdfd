"""Distributed autograd: ``context()``, ``backward(context_id, roots)``, ``get_gradients``.

Same names and signatures as ``torch.distributed.autograd``. See [Note: distributed backward]
in engine.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from shardwise.rpc.autograd.context import DistAutogradContext
from shardwise.rpc.autograd.engine import backward as _backward
from shardwise.rpc.current import get_agent

__all__ = ["DistAutogradContext", "backward", "context", "get_gradients"]


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A new distributed autograd context; yields its id. RPCs made inside it join its graph.

    On exit the context is released here and on every worker it reached.
    """
    agent = get_agent()
    ctx = agent.autograd.new_context()
    try:
        with agent.autograd.bound(ctx.context_id):
            yield ctx.context_id
    finally:
        for fut in agent.autograd.release(ctx.context_id):
            with contextlib.suppress(Exception):
                fut.wait()


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run backward from scalar ``roots`` through every RPC of the context; returns when done.

    Gradients are accumulated in the context on each worker (see :func:`get_gradients`), not in
    ``.grad``. The graph is always kept until the context exits (``retain_graph`` is accepted
    for torch's signature).
    """
    agent = get_agent()
    _backward(agent, agent.autograd.get(context_id), list(roots))


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's accumulated gradients in the context: ``{tensor: grad}``."""
    return get_agent().autograd.get(context_id).gradients()
