"""shardwise: PyTorch's distributed training toolkit, faster and clearer.

The public API. Mechanisms live in subpackages; this module only names them, and imports each
(and torch) on first access, so that ``import shardwise`` and the command line's ``--help``
cost no torch import. The first name resolved also runs the torch version check once.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it (a subpackage's own name: the subpackage itself)
_WHERE = {
    "CPUOffload": "shardwise.fsdp",
    "CPUOffloadPolicy": "shardwise.fsdp",
    "DistributedDataParallel": "shardwise.ddp",
    "FSDPModule": "shardwise.fsdp",
    "FullyShardedDataParallel": "shardwise.fsdp",
    "MixedPrecision": "shardwise.fsdp",
    "MixedPrecisionPolicy": "shardwise.fsdp",
    "OffloadPolicy": "shardwise.fsdp",
    "ZeroDataParallel": "shardwise.zero",
    "ZeroRedundancyOptimizer": "shardwise.zero",
    "distributed": "shardwise.distributed",
    "fully_shard": "shardwise.fsdp",
    "rpc": "shardwise.rpc",
    "sharded_tensor": "shardwise.sharded_tensor",
}
__all__ = sorted(_WHERE)
_checked = False  # whether the torch version check has run in this process


def __getattr__(name: str) -> Any:
    """Resolve a public name from its subpackage on first access (PEP 562)."""
    global _checked
    if name not in _WHERE:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    if not _checked:
        _checked = True
        importlib.import_module("shardwise._compat").warn_once_if_untested()
    module = importlib.import_module(_WHERE[name])
    value = module if _WHERE[name] == f"shardwise.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
