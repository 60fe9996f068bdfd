"""``enable_wrap`` / ``wrap``: torch FSDP1's manual wrapping, and the auto-wrap policies, under
the module path torch gives them (``torch.distributed.fsdp.wrap``).

Inside ``with enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs):`` each
``wrap(module, **overrides)`` returns ``wrapper_cls(module, **{**kwargs, **overrides})`` (a
keyword given to ``wrap`` wins over the context's; a module's own ``_wrap_overrides`` attribute,
which torch's auto-wrapping sets, wins over both); outside any context ``wrap`` returns the
module unchanged, so one model definition builds with or without FSDP. Contexts do not nest
(torch's ``NotImplementedError``). As torch's, the context is one per process, not per thread:
it is the module-level ``_context`` below, set and cleared by ``enable_wrap`` only.

This module can also be called: ``shardwise.fsdp.wrap(layer)`` is ``wrap(layer)`` (the package
attribute and the module path ``shardwise.fsdp.wrap`` are this module: fsdp/__init__.py).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Generator
from typing import Any

from torch import nn

from shardwise.fsdp.fsdp1.policies import (
    ModuleWrapPolicy,
    SizeBasedWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)


class _WrapContext:
    """The open ``enable_wrap`` context, if any."""

    def __init__(self) -> None:
        self.active = False
        self.wrapper_cls: Any = None
        self.kwargs: dict[str, Any] = {}


_context = _WrapContext()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Within this context ``wrap(m)`` wraps ``m`` in ``wrapper_cls(m, **wrapper_kwargs)``."""
    if _context.active:
        raise NotImplementedError("enable_wrap: already within an enable_wrap context; "
                                  "contexts do not nest (as in torch)")
    if wrapper_cls is None or not callable(wrapper_cls):
        raise TypeError(f"enable_wrap: wrapper_cls must be a class such as "
                        f"FullyShardedDataParallel, got {wrapper_cls!r}")
    _context.active, _context.wrapper_cls, _context.kwargs = True, wrapper_cls, wrapper_kwargs
    try:
        yield
    finally:
        _context.active, _context.wrapper_cls, _context.kwargs = False, None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``module`` wrapped by the open ``enable_wrap`` context's class (``wrap_overrides`` win
    over the context's keywords), or ``module`` itself outside any context."""
    if not _context.active:
        return module
    kwargs = {**_context.kwargs, **wrap_overrides, **getattr(module, "_wrap_overrides", {})}
    return _context.wrapper_cls(module, **kwargs)


class _CallableModule(types.ModuleType):
    def __call__(self, module: nn.Module, **wrap_overrides: Any) -> nn.Module:
        return wrap(module, **wrap_overrides)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "ModuleWrapPolicy",
    "SizeBasedWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
