"""The transformers ``Trainer`` with shardwise's DistributedDataParallel.

The Trainer hands the model to its accelerate ``Accelerator`` (``accelerator.prepare``), which
wraps it in torch's DDP on several processes. ``ShardwiseDDPTrainerMixin`` overrides the
Trainer's public ``create_accelerator_and_postprocess`` so that the accelerator it creates
wraps with ``shardwise.DistributedDataParallel`` instead (accelerate.py's
``use_shardwise_ddp``)::

    class Trainer(ShardwiseDDPTrainerMixin, transformers.Trainer):
        pass

Everything else (gradient accumulation through ``no_sync``, saving through
``accelerator.unwrap_model``) runs unchanged: our wrapper is a torch DDP to ``isinstance``.
"""

from __future__ import annotations

from shardwise.integrations._require import framework

framework("transformers", "transformers", "transformers")
from shardwise.integrations.accelerate import use_shardwise_ddp  # noqa: E402 (needs accelerate)


class ShardwiseDDPTrainerMixin:
    """Mix in before ``transformers.Trainer``: its accelerator wraps with shardwise's DDP.

    Keyword arguments for our DDP's constructor go in the class attribute
    ``shardwise_ddp_kwargs`` (torch's names, e.g. ``{"bucket_cap_mb": 10}``)."""

    shardwise_ddp_kwargs: dict = {}

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_shardwise_ddp(self.accelerator, **self.shardwise_ddp_kwargs)
