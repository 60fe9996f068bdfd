"""The optimizer and learning-rate schedule every strategy of `shardwise train` uses."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardwise.cli.train_args import TrainConfig

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01


def make_adamw(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then constant: a function of the step alone,
    so a resumed run follows the same schedule without any saved scheduler state."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr
