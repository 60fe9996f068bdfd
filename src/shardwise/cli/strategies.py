"""The parallel strategies `shardwise train --strategy NAME` knows.

Each entry names a builder ``build(model, cfg, group, device) -> Prepared`` by import path, so a
strategy's mechanism is imported only when it is chosen. To add one, write
``cli/strategy_<name>.py`` with its builder and add one line to ``STRATEGIES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the strategies' names and descriptions cost no torch import
    import torch
    from torch import nn


@dataclass
class Prepared:
    """A model made ready for one strategy, with what the training loop needs of it."""

    model: nn.Module  # what forward is called on
    optimizer: torch.optim.Optimizer
    # (index, count): which of `count` equal slices of each global batch this rank trains and
    # evaluates on. None means (rank, world size), as in data parallelism; a strategy whose
    # ranks all work on the same batch (tensor parallelism) says (0, 1).
    data_slice: tuple[int, int] | None = None
    # forward + backward on one batch, returning the detached scalar loss; None means
    # ``lm_loss(model(x), y).backward()``. For strategies whose step is not one module call.
    train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Checkpoints: the module whose state ``shardwise.checkpoint.get_state_dict`` takes (None:
    # ``model``), and which of its entries this rank holds (None: all of them; a pipeline
    # stage holds its own layers' only).
    state_model: nn.Module | None = None
    owned_state: Callable[[str], bool] | None = None


# name -> (module:function of the builder, one-line description)
STRATEGIES: dict[str, tuple[str, str]] = {
    "ddp": ("shardwise.cli.strategy_ddp:build", "DistributedDataParallel, AdamW replicated"),
    "zero1": ("shardwise.cli.strategy_zero:build_zero1", "DDP + ZeRO stage 1: AdamW state sharded"),
    "zero2": ("shardwise.cli.strategy_zero:build_zero2", "ZeRO stage 2: AdamW state and gradients "
              "sharded"),
    "tp": ("shardwise.cli.strategy_tp:build", "tensor parallel (sharded tensors), AdamW on shards"),
    "pipeline": ("shardwise.cli.strategy_pipeline:build", "GPT stages (shardwise.pipeline): "
                 "--schedule, --microbatches, --dp, --transport"),
    "fsdp": ("shardwise.cli.strategy_fsdp:build", "FullyShardedDataParallel, one unit per block "
             "(--tp T: FSDP x tensor parallel)"),
    "hsdp": ("shardwise.cli.strategy_fsdp:build_hybrid", "FSDP HYBRID_SHARD: sharded within "
             "groups, replicated across --replicas (default: nodes)"),
}


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def check_strategy(name: str) -> None:
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}; valid strategies: {', '.join(strategy_names())}"
        )


def get_builder(name: str) -> Callable[..., Prepared]:
    check_strategy(name)
    module, _, func = STRATEGIES[name][0].partition(":")
    return getattr(importlib.import_module(module), func)
