"""`--strategy zero1` and `--strategy zero2`: ZeRO with AdamW state (and, for zero2, gradients)
sharded across the ranks.

Checkpoints (cli/checkpointing.py): each rank writes the optimizer state of the parameters it
owns (nothing is gathered on rank 0), keyed by parameter name, so a run resumes under any
strategy and world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.cli.optim import BETAS, WEIGHT_DECAY
from shardwise.cli.strategies import Prepared
from shardwise.cli.train_args import TrainConfig
from shardwise.ddp import DistributedDataParallel
from shardwise.zero import ZeroDataParallel, ZeroRedundancyOptimizer


def build_zero1(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
                device: torch.device) -> Prepared:
    wrapped = DistributedDataParallel(model.to(device), process_group=group)
    return _prepared(model, wrapped, _optimizer(model, cfg, group), group)


def build_zero2(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
                device: torch.device) -> Prepared:
    optimizer = _optimizer(model.to(device), cfg, group)
    return _prepared(model, ZeroDataParallel(model, optimizer), optimizer, group)


def _optimizer(model: nn.Module, cfg: TrainConfig,
               group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group,
                                   lr=cfg.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _prepared(model: nn.Module, wrapped: nn.Module, optimizer: ZeroRedundancyOptimizer,
              group: dist.ProcessGroup) -> Prepared:
    def state_dict() -> dict[str, Any]:
        optimizer.consolidate_state_dict(to=0)  # collective: every rank calls this
        if dist.get_rank(group) != 0:
            return {}
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return Prepared(wrapped, optimizer, state_dict, load_state_dict, per_rank_state=False)
