"""The one error an integration raises when its framework is not installed."""

from __future__ import annotations

import importlib
from types import ModuleType


def framework(module: str, integration: str, extra: str) -> ModuleType:
    """Import ``module`` or fail naming the integration and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"shardwise.integrations.{integration} needs {module!r}, which is not "
                          f"installed: pip install 'shardwise[{extra}]'") from err
