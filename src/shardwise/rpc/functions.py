"""``shardwise.rpc.functions.async_execution``, as ``torch.distributed.rpc.functions``.

A function decorated with :func:`async_execution` returns a ``torch.futures.Future`` (also the
``torch._C.Future`` that ``fut.then(...)`` and ``torch.futures.collect_all`` return) instead of
its result; the callee answers the RPC when that future completes, and no pool thread waits
for it in between. This is how a parameter server batches updates: every trainer's call
returns the same pending future, and the call that completes the batch sets its result.

It works with ``rpc_sync``, ``rpc_async`` and ``remote`` and with the RRef helpers. On methods,
put it under ``@staticmethod`` / ``@classmethod`` (innermost), as torch requires.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from shardwise._compat import FUTURE_TYPE

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_wrapped_async_rpc_function"  # torch's attribute name, so that either API sees it


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a future whose value is the RPC's reply."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, _MARK, fn)
    return wrapper  # type: ignore[return-value]


def is_async_execution(func: Any) -> bool:
    """Whether ``func`` (a function, or a bound/class method of one) was decorated."""
    return hasattr(getattr(func, "__func__", func), _MARK)


def is_future(value: Any) -> bool:
    """``torch.futures.Future`` and the plain ``torch._C.Future`` of ``then`` / ``collect_all``."""
    return isinstance(value, FUTURE_TYPE)


def check_async_result(func: Any, result: Any) -> None:
    """An ``@async_execution`` function must return a future (torch's rule)."""
    if is_async_execution(func) and not is_future(result):
        name = getattr(func, "__qualname__", repr(func))
        raise TypeError(f"@async_execution function {name} must return a torch.futures.Future, "
                        f"got {type(result).__name__}")
