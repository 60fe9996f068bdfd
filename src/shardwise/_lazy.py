"""Public names of a package resolved on first access, so that importing the package, or one
torch-free module inside it (an environment reader, a timeout), does not import torch.

A package's ``__init__`` names where each public name is defined::

    lazy_names(__name__, {"init": "shardwise.distributed.init", ...})

and ``package.NAME`` or ``from package import NAME`` imports that module the first time. A
public name that is also the name of its own submodule (``shardwise.distributed.init``, the
function in ``init.py``) keeps meaning the name: importing the submodule does not replace it
on the package, as the eager ``from .init import init`` did not.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> None:
    """Make the public names of ``package`` (``where``: name -> defining module) lazy."""
    where = dict(where)

    class LazyPackage(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name not in where:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(where[name]), name)
            setattr(self, name, value)
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            if (name in where and isinstance(value, types.ModuleType)
                    and value.__name__ == f"{package}.{name}" == where[name]):
                value = getattr(value, name)  # the import system recording the submodule
            super().__setattr__(name, value)

        def __dir__(self) -> list[str]:
            return sorted({*vars(self), *where})

    sys.modules[package].__class__ = LazyPackage
