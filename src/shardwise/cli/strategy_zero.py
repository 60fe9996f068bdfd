"""`--strategy zero1` and `--strategy zero2`: ZeRO with AdamW state (and, for zero2, gradients)
sharded across the ranks.

Checkpoints (cli/checkpointing.py): each rank writes the optimizer state of the parameters it
owns (nothing is gathered on rank 0), keyed by parameter name, so a run resumes under any
strategy and world size.
"""

from __future__ import annotations

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
    return Prepared(wrapped, _optimizer(model, cfg, group))


def build_zero2(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
                device: torch.device) -> Prepared:
    optimizer = _optimizer(model.to(device), cfg, group)
    return Prepared(ZeroDataParallel(model, optimizer), optimizer)


def _optimizer(model: nn.Module, cfg: TrainConfig,
               group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group,
                                   lr=cfg.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
