"""PyTorch Lightning's Trainer on shardwise's DistributedDataParallel.

Importing this module registers ``ShardwiseDDPStrategy`` in Lightning's strategy registry
under ``"shardwise_ddp"`` (and ``"shardwise_ddp_find_unused_parameters_true"``), so that
``Trainer(strategy="shardwise_ddp", devices=2)`` wraps the LightningModule with
``shardwise.DistributedDataParallel`` instead of torch's. Our wrapper is a torch DDP to
``isinstance`` (ddp/torch_ddp.py), so the rest of Lightning's DDP strategy (``no_sync`` under
gradient accumulation, ``teardown`` returning the bare module, checkpoint state dicts) runs
unchanged. For FSDP2 use Lightning's own ``ModelParallelStrategy`` with ``shardwise.fully_shard``
in ``configure_model`` (docs/integrations.md).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

import shardwise
from shardwise.integrations._require import framework
from shardwise.integrations.ddp_strategy_names import NAME, register_ddp_strategy

_strategies = framework("pytorch_lightning.strategies", "lightning", "lightning")



class ShardwiseDDPStrategy(_strategies.DDPStrategy):
    """Lightning's ``DDPStrategy`` whose wrapper is ``shardwise.DistributedDataParallel``.

    Keyword arguments beyond Lightning's own go to our DDP's constructor (torch's names:
    ``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``, ...); an unknown one is a
    ``TypeError`` when the model is wrapped."""

    strategy_name = NAME

    def _setup_model(self, model: nn.Module) -> shardwise.DistributedDataParallel:
        # the hook Lightning's DDPStrategy.configure_ddp calls to wrap the module
        return shardwise.DistributedDataParallel(
            module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def pre_backward(self, closure_loss: Tensor) -> None:
        """With manual optimization Lightning prepares torch's C++ reducer for the backward;
        ours needs no preparation (its hooks read ``require_backward_grad_sync`` when the
        gradients arrive), so only the buffer flag torch's preparation sets is kept."""
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            self.model.require_forward_param_sync = self.model.require_backward_grad_sync

    def post_backward(self, closure_loss: Tensor) -> None:
        """Lightning flushes torch's reducer after a static graph's first manual backward;
        ours finishes every backward's reduction itself."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_ddp_strategy(strategy_registry, cls)


ShardwiseDDPStrategy.register_strategies(_strategies.StrategyRegistry)
