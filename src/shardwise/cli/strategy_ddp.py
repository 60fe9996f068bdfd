"""`--strategy ddp`: our DistributedDataParallel with a replicated AdamW."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.cli.optim import make_adamw
from shardwise.cli.strategies import Prepared
from shardwise.cli.train_args import TrainConfig
from shardwise.ddp import DistributedDataParallel


def build(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
          device: torch.device) -> Prepared:
    ddp = DistributedDataParallel(model.to(device), process_group=group)
    optimizer = make_adamw(ddp.parameters(), cfg)

    return Prepared(ddp, optimizer)
