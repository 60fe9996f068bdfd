"""Methods of torch's classes that shardwise's subclasses cannot honour, refused by name.

Our ``DistributedDataParallel`` and ``FSDPModule`` derive from torch's classes so that
``isinstance`` checks in frameworks hold; a method of torch's class that ours does not implement
would run torch's code on state ours does not have, so each is replaced by one that raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def refused_method(name: str, torch_class: str, ours: str, why: str) -> Callable[..., NoReturn]:
    """A method ``name`` that raises ``NotImplementedError``: it is ``torch_class``'s (e.g.
    "torch's DistributedDataParallel"), it cannot work on ``ours`` (e.g. "a module sharded by
    shardwise.fully_shard"), and ``why`` says why and what to use instead."""
    owner = torch_class.rsplit(" ", 1)[-1]

    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__}.{name}() is {torch_class}.{name}; "
                                  f"on {ours} it cannot work: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"torch's ``{owner}.{name}``: not supported ({why})."
    return method
