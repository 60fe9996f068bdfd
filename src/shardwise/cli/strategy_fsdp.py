"""`--strategy fsdp` and `--strategy hsdp`: our FullyShardedDataParallel, one unit per transformer
block, AdamW on the local shards; `--mixed-precision bf16|fp16` computes in that dtype (fp32
master shards and gradient reduction), `--cpu-offload` keeps shards and gradients on the CPU.
Checkpoints: each rank writes its own parameter and AdamW shards (cli/checkpointing.py).

- ``fsdp``: FULL_SHARD over the world; with ``--tp T``, FSDP x TP on a ``(world / T, T)``
  = (dp, tp) mesh: the demo GPT is made tensor-parallel over ``mesh["tp"]`` by
  `--strategy tp`'s plan, then sharded over ``mesh["dp"]`` (see [Note: FSDP x TP],
  fsdp/tp_params.py); the ranks of one tp group train on the same slice of the batch.
- ``hsdp``: HYBRID_SHARD on a ``(replicas, world / replicas)`` = (replicate, shard) mesh;
  ``--replicas`` defaults to the number of nodes (shard within a node, replicate across).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.cli.optim import make_adamw
from shardwise.cli.strategies import Prepared
from shardwise.cli.strategy_tp import check_gpt, gpt_plan
from shardwise.cli.train_args import TrainConfig
from shardwise.distributed.mesh import init_device_mesh
from shardwise.distributed.topology import (
    HSDP_DIM_NAMES,
    TP_DIM_NAMES,
    local_world_size_from_env,
)
from shardwise.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from shardwise.models.gpt import Block
from shardwise.sharded_tensor import shard_module

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
          device: torch.device) -> Prepared:
    if cfg.tp == 1:
        return _prepare(model.to(device), cfg, process_group=group)
    world = dist.get_world_size(group)
    mesh = init_device_mesh(device.type, (world // cfg.tp, cfg.tp), mesh_dim_names=TP_DIM_NAMES)
    check_gpt(model, cfg.tp, "--tp")
    model.to(device)  # before sharding: see [Note: how a sharded parameter appears]
    plan, gathered = gpt_plan(mesh["tp"].get_group())
    shard_module(model, plan, gather_output=gathered, process_group=mesh["tp"].get_group())
    prepared = _prepare(model, cfg, device_mesh=mesh["dp"])
    prepared.data_slice = (mesh.get_local_rank("dp"), mesh.size(0))
    return prepared


def build_hybrid(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
                 device: torch.device) -> Prepared:
    world = dist.get_world_size(group)
    replicas = cfg.replicas or max(1, world // local_world_size_from_env(world))
    mesh = init_device_mesh(device.type, (replicas, world // replicas),
                            mesh_dim_names=HSDP_DIM_NAMES)
    if dist.get_rank(group) == 0:
        print(f"hsdp: mesh replicate {replicas} x shard {world // replicas}", flush=True)
    return _prepare(model.to(device), cfg, device_mesh=mesh,
                    sharding_strategy=ShardingStrategy.HYBRID_SHARD)


def _prepare(model: nn.Module, cfg: TrainConfig, **where) -> Prepared:
    mp = None
    if cfg.mixed_precision:
        mp = MixedPrecision(param_dtype=DTYPES[cfg.mixed_precision], reduce_dtype=torch.float32)
    fsdp = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    mixed_precision=mp,
                                    cpu_offload=CPUOffload(offload_params=cfg.cpu_offload),
                                    **where)
    optimizer = make_adamw(fsdp.parameters(), cfg)

    return Prepared(fsdp, optimizer)
