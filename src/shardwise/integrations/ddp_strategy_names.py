"""The names under which Lightning's and Fabric's strategy registries find shardwise's DDP.

Both frameworks keep a registry with the same ``register(name, cls, description=...,
**init_kwargs, override=...)`` call, so one function registers a strategy class in either.
"""

from __future__ import annotations

from typing import Any

NAME = "shardwise_ddp"


def register_ddp_strategy(registry: Any, cls: type) -> None:
    """Register ``cls`` as ``shardwise_ddp`` and ``shardwise_ddp_find_unused_parameters_true``
    (the second with ``find_unused_parameters=True``, as the frameworks name torch's)."""
    registry.register(NAME, cls, description="DDP with shardwise's DistributedDataParallel",
                      override=True)
    registry.register(f"{NAME}_find_unused_parameters_true", cls,
                      description=f"{NAME} with find_unused_parameters=True",
                      find_unused_parameters=True, override=True)
