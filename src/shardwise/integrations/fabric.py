"""Lightning Fabric on shardwise's DistributedDataParallel.

Importing this module registers ``ShardwiseFabricDDPStrategy`` in Fabric's strategy registry
under ``"shardwise_ddp"``: ``Fabric(strategy="shardwise_ddp", devices=2)``. ``fabric.setup``
then wraps the module with ``shardwise.DistributedDataParallel``, and
``fabric.no_backward_sync(model)`` enters its ``no_sync()`` (our wrapper is a torch DDP to
``isinstance``, ddp/torch_ddp.py). For FSDP2 use Fabric's ``ModelParallelStrategy`` with a
``parallelize_fn`` that calls ``shardwise.fully_shard`` (docs/integrations.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn

import shardwise
from shardwise.integrations._require import framework

_strategies = framework("lightning_fabric.strategies", "fabric", "lightning")

NAME = "shardwise_ddp"


class ShardwiseFabricDDPStrategy(_strategies.DDPStrategy):
    """Fabric's ``DDPStrategy`` whose wrapper is ``shardwise.DistributedDataParallel``; keyword
    arguments beyond Fabric's go to our DDP's constructor."""

    def setup_module(self, module: nn.Module) -> shardwise.DistributedDataParallel:
        return shardwise.DistributedDataParallel(
            module=module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="DDP with shardwise's "
                                   "DistributedDataParallel", override=True)
        strategy_registry.register(f"{NAME}_find_unused_parameters_true", cls,
                                   description="shardwise_ddp with find_unused_parameters=True",
                                   find_unused_parameters=True, override=True)


ShardwiseFabricDDPStrategy.register_strategies(_strategies.STRATEGY_REGISTRY)
