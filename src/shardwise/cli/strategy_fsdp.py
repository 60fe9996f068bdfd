"""`--strategy fsdp`: our FullyShardedDataParallel, one unit per transformer block, AdamW on the
local shards; `--mixed-precision bf16|fp16` computes in that dtype (fp32 master shards and
gradient reduction), `--cpu-offload` keeps shards and gradients on the CPU. Checkpoints: each
rank writes its own parameter and AdamW shards (cli/checkpointing.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.cli.optim import make_adamw
from shardwise.cli.strategies import Prepared
from shardwise.cli.train_args import TrainConfig
from shardwise.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    load_sharded_state_dict,
    sharded_state_dict,
)
from shardwise.models.gpt import Block

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
          device: torch.device) -> Prepared:
    mp = None
    if cfg.mixed_precision:
        mp = MixedPrecision(param_dtype=DTYPES[cfg.mixed_precision], reduce_dtype=torch.float32)
    fsdp = FullyShardedDataParallel(model.to(device), process_group=group,
                                    auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    mixed_precision=mp,
                                    cpu_offload=CPUOffload(offload_params=cfg.cpu_offload))
    optimizer = make_adamw(fsdp.parameters(), cfg)

    def state_dict() -> dict:
        return {"model": sharded_state_dict(fsdp), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        load_sharded_state_dict(fsdp, state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return Prepared(fsdp, optimizer, state_dict, load_state_dict, per_rank_state=True)
