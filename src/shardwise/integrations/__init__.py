"""Glue between training frameworks and shardwise (docs/integrations.md).

Each submodule imports its framework and is imported only by the user (nothing in shardwise
imports this package); the extra in brackets installs the framework:

- ``lightning``: the Lightning Trainer's strategy ``"shardwise_ddp"`` (``shardwise[lightning]``)
- ``fabric``: Lightning Fabric's strategy ``"shardwise_ddp"`` (``shardwise[lightning]``)
- ``accelerate``: ``prepare(accelerator, *objs)`` (``shardwise[accelerate]``)
- ``transformers``: ``ShardwiseDDPTrainerMixin`` for the Trainer (``shardwise[transformers]``)
"""
