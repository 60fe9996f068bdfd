"""One rank of `shardwise train`: join the group, train, report, leave."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from shardwise.cli.train_args import ConfigError, TrainConfig, validate
from shardwise.cli.train_loop import train
from shardwise.distributed import destroy, init, read_env


def train_rank(cfg: TrainConfig) -> int:
    env = read_env()
    try:
        validate(cfg, env.world_size)
    except ConfigError as exc:
        print(f"shardwise train: error: {exc}", file=sys.stderr)
        return 2
    device = _device(cfg, env.local_rank)
    group = init("nccl" if device.type == "cuda" else "gloo")
    try:
        result = train(cfg, group, device)
        if dist.get_rank(group) == 0:
            last = max(result.losses) if result.losses else None
            if result.val_start is not None:
                print(f"validation loss at start: {result.val_start:.4f}")
            print(f"validation loss at end:   {result.val_end:.4f}")
            if last is not None:
                print(f"train loss at step {last + 1}: {result.losses[last]:.6f}")
            mem = ", ".join(f"rank{r} {m:.0f} MiB" for r, m in enumerate(result.peak_mib))
            print(f"throughput: {result.tokens_per_s:,.0f} tokens/s; peak memory: {mem}")
    finally:
        destroy()
    return 0


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("shardwise train: error: --device cuda but no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
