"""The distributed autograd contexts of one agent and the current context of each thread.

A context id is unique across the group (the creating rank in the high bits). A request sent
inside a context carries its id; the callee runs the function inside the same context (made on
first use), so nested RPCs and results stay on the same distributed graph.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch

from shardwise.rpc.autograd.context import DistAutogradContext, GradKey
from shardwise.rpc.messages import Kind

_RANK_SHIFT = 48


class _ThreadState(threading.local):
    context_id: int | None = None  # (a class default: no AttributeError to catch per call)


class AutogradContainer:
    def __init__(self, agent) -> None:
        self._agent = agent
        self._contexts: dict[int, DistAutogradContext] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._tls = _ThreadState()

    # ---------------------------------------------------------------- lifetime
    def new_context(self) -> DistAutogradContext:
        ctx = DistAutogradContext((self._agent.rank << _RANK_SHIFT) | next(self._ids))
        with self._lock:
            self._contexts[ctx.context_id] = ctx
        return ctx

    def get(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(f"no distributed autograd context {context_id} on worker "
                               f"{self._agent.name!r} (exited, or never reached this worker)")
        return ctx

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def release(self, context_id: int, origin: int | None = None) -> list[torch.futures.Future]:
        """Forget a context here and tell every peer it touched (they forward it on).

        The context (this worker's part of the graph, its saved activations) is dropped under
        the lock, before the peers are told: a release of the same id racing with this one (a
        peer's forwarded release and the owner's own, as a pipeline sends them) finds nothing
        and returns, and must not return while this call still holds the graph."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
            if ctx is None:
                return []
            peers = sorted(ctx.peers)
            del ctx
        return [self._agent.request(p, Kind.CTX_RELEASE, (context_id,),
                                    self._agent.options.rpc_timeout, "autograd context release",
                                    ctx_id=None)
                for p in peers if p != origin and p not in self._agent.dead]

    # ---------------------------------------------------------------- current context
    def current_id(self) -> int | None:
        return self._tls.context_id

    @contextlib.contextmanager
    def bound(self, context_id: int | None) -> Iterator[None]:
        outer = self._tls.context_id
        if context_id is not None:
            self.get_or_create(context_id)
        self._tls.context_id = context_id
        try:
            yield
        finally:
            self._tls.context_id = outer

    # ---------------------------------------------------------------- messages
    def record_send(self, context_id: int, key: int, tensors: list, peer: int) -> None:
        self.get_or_create(context_id).record_send(key, tensors, peer)

    def note_peer(self, context_id: int, peer: int) -> None:
        ctx = self.get_or_create(context_id)
        with ctx.lock:
            ctx.peers.add(peer)

    def record_recv(self, context_id: int, key: GradKey, tensors: list, peer: int) -> None:
        self.get_or_create(context_id).record_recv(key, tensors, peer)

    def on_backward(self, context_id: int, key: int, grads: list) -> torch.futures.Future:
        from shardwise.rpc.autograd.engine import propagate

        ctx = self.get(context_id)
        with ctx.lock:
            tensors = ctx.sends.get(key)
        if tensors is None:
            raise RuntimeError(f"gradients for unknown message {key} in context {context_id}")
        return propagate(self._agent, ctx, tensors, grads)
