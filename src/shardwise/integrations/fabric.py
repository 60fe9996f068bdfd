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
from shardwise.integrations.ddp_strategy_names import register_ddp_strategy

_strategies = framework("lightning_fabric.strategies", "fabric", "lightning")


class ShardwiseFabricDDPStrategy(_strategies.DDPStrategy):
    """Fabric's ``DDPStrategy`` whose wrapper is ``shardwise.DistributedDataParallel``; keyword
    arguments beyond Fabric's go to our DDP's constructor."""

    def setup_module(self, module: nn.Module) -> shardwise.DistributedDataParallel:
        return shardwise.DistributedDataParallel(
            module=module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_ddp_strategy(strategy_registry, cls)


ShardwiseFabricDDPStrategy.register_strategies(_strategies.STRATEGY_REGISTRY)
