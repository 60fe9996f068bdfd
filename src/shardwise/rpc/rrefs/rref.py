"""RRef: a reference to a value owned by one worker, usable from any worker.

See [Note: RRef reference counting] in rref_context.py for how the owner knows when to free,
and [Note: RRef ids are capabilities] there for who may use an id.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

from shardwise.rpc.current import get_agent
from shardwise.rpc.functions import check_async_result
from shardwise.rpc.messages import Kind
from shardwise.rpc.options import UNSET_RPC_TIMEOUT, WorkerInfo
from shardwise.rpc.trust.callables import ForbiddenCallable, register
from shardwise.rpc.trust.methods import check_method_name, resolve_method
from shardwise.rpc.trust.serialization import current_session

T = TypeVar("T")


class RRef(Generic[T]):
    """``RRef(value)`` makes an owner reference to a local value; ``remote()`` makes others."""

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = get_agent()
        entry = agent.rrefs.new_local(value)
        self._setup(agent, entry.rref_id, agent.rank, entry, None)

    def _setup(self, agent, rref_id, owner: int, entry, fork) -> None:
        self._agent, self._id, self._owner_rank = agent, tuple(rref_id), owner
        self._entry, self._fork = entry, fork
        self._created: torch.futures.Future | None = None

    @classmethod
    def _make(cls, agent, rref_id, owner: int, entry=None, fork=None) -> RRef:
        rref = cls.__new__(cls)
        rref._setup(agent, rref_id, owner, entry, fork)
        return rref

    def __del__(self) -> None:
        fork = getattr(self, "_fork", None)
        if fork is not None:
            self._agent.rrefs.user_deleted(self._id, self._owner_rank, fork)

    def __reduce__(self) -> tuple:
        session = current_session()  # RRefs are pickled only inside RPC messages
        if session.hooks is None:
            raise RuntimeError("an RRef can only be sent inside an RPC message")
        return session.hooks.reduce_rref(self, session.peer)

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(id={self._id}, owner={self.owner_name()!r})"

    # ---------------------------------------------------------------- identity
    def is_owner(self) -> bool:
        return self._entry is not None

    def owner(self) -> WorkerInfo:
        return self._agent.workers[self._owner_rank]

    def owner_name(self) -> str:
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        return self.is_owner() or self._created is None or self._created.done()

    # ---------------------------------------------------------------- values
    def local_value(self) -> T:
        if self._entry is None:
            raise RuntimeError(f"local_value() on a user RRef; the value lives on "
                               f"{self.owner_name()!r}: use to_here()")
        return self._entry.future.wait()

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """The value, fetched from the owner (a copy) unless this worker owns it."""
        if self._entry is not None:
            return self.local_value()
        agent = self._agent
        fut = agent.request(self._owner_rank, Kind.FETCH, (self._id,), agent.timeout_of(timeout),
                            f"to_here() from {self.owner_name()!r}")
        return fut.wait()

    # ---------------------------------------------------------------- autograd
    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Backward from this RRef's value (a scalar tensor), as torch's ``RRef.backward``.

        ``dist_autograd_ctx_id`` -1: a local backward (``.grad``), only on the owner. Otherwise
        a distributed backward of that context started on the owner (an RPC when the owner is
        another worker); gradients are then read with ``autograd.get_gradients``.
        """
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                raise RuntimeError(f"RRef.backward() without a distributed autograd context "
                                   f"runs on the owner only; this RRef is owned by "
                                   f"{self.owner_name()!r}")
            _scalar_value(self).backward(retain_graph=retain_graph)
            return
        if self.is_owner():
            backward_on_owner(self, dist_autograd_ctx_id, retain_graph)
            return
        from shardwise.rpc import api

        api.rpc_sync(self.owner(), backward_on_owner,
                     args=(self, dist_autograd_ctx_id, retain_graph))

    # ---------------------------------------------------------------- proxies
    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        return _Proxy(self, "remote", timeout)


class _Proxy:
    def __init__(self, rref: RRef, how: str, timeout: float):
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, method: str):
        from shardwise.rpc import api

        call = getattr(api, self._how)
        rref, timeout = self._rref, self._timeout

        def invoke(*args, **kwargs):
            return call(rref.owner(), invoke_method, args=(method, rref, args, kwargs),
                        timeout=timeout)

        return invoke


@register
def invoke_method(method: str, rref: RRef, args: tuple, kwargs: dict) -> Any:
    """Runs on the owner: ``rref.local_value().method(*args, **kwargs)`` (a future returned by
    an ``@async_execution`` method is answered when it completes, see functions.py), for a
    method that rule 5 of [Note: allow-list] allows (trust/methods.py): a peer does not reach
    ``__reduce_ex__``, ``numpy``, ``tofile`` or an attribute of the instance."""
    check_method_name(method)
    if not isinstance(rref, RRef):
        raise ForbiddenCallable(f"RRef proxy calls need an RRef, got {type(rref).__name__}")
    target = resolve_method(rref.local_value(), method)
    result = target(*args, **kwargs)
    check_async_result(target, result)
    return result


def _scalar_value(rref: RRef) -> torch.Tensor:
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"RRef.backward() needs an RRef of a tensor, this one holds a "
                           f"{type(value).__name__}")
    return value


@register
def backward_on_owner(rref: RRef, context_id: int, retain_graph: bool) -> None:
    """Runs on the owner: a distributed backward of ``context_id`` from the RRef's value."""
    from shardwise.rpc import autograd

    autograd.backward(context_id, [_scalar_value(rref)], retain_graph=retain_graph)


@register
def rebuild_rref(rref_id, owner: int, fork) -> RRef:
    """An RRef received in a message. Its owner serves it only to a sender that holds it
    ([Note: RRef ids are capabilities] in rref_context.py): ForbiddenRRef otherwise."""
    session = current_session()
    agent = session.hooks
    if owner == agent.rank:
        entry = agent.rrefs.held(rref_id, session.peer)
        return RRef._make(agent, entry.rref_id, owner, entry=entry)
    return RRef._make(agent, rref_id, owner, fork=tuple(fork))
