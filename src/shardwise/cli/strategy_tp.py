"""`--strategy tp`: tensor parallelism (Megatron style) of the demo GPT through shard_module.

Every rank trains on the same batch (``data_slice=(0, 1)``) and holds its shards of the sharded
weights; the rest (layer norms, row-wise biases) is replicated and stays identical on every rank
because every rank computes the same thing. Per block: the attention's ``qkv`` column-wise (whole
heads per rank) and ``proj`` row-wise; the MLP's ``fc1`` column-wise and ``fc2`` row-wise: one
all-reduce forward and one backward for each pair. The token embedding is sharded on the
vocabulary, the position embedding on the embedding dim, the LM head column-wise on the
vocabulary with its logits gathered for the loss. Checkpoints: each rank writes its shards and
their AdamW state, rank 0 the replicated rest (cli/checkpointing.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.cli.mesh_args import heads_problem
from shardwise.cli.optim import make_adamw
from shardwise.cli.strategies import Prepared
from shardwise.cli.train_args import TrainConfig
from shardwise.sharded_tensor import ChunkShardingSpec, shard_module


def gpt_plan(ranks: int | Sequence[int] | dist.ProcessGroup
             ) -> tuple[dict[str, ChunkShardingSpec], list[str]]:
    """The demo GPT's sharding plan over a tensor-parallel group and the modules whose output is
    gathered. Placements name global ranks ([Note: global ranks in placements]): pass the group,
    or its global ranks in order; an int ``n`` means the global ranks 0..n-1."""
    if isinstance(ranks, dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(ranks)
    ranks = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
    colwise, rowwise = ChunkShardingSpec(0, ranks), ChunkShardingSpec(1, ranks)
    plan = {
        "tok_emb": colwise,  # chunked on the vocabulary
        "pos_emb": rowwise,  # chunked on the embedding dim
        "blocks.*.attn.qkv": colwise,
        "blocks.*.attn.proj": rowwise,
        "blocks.*.mlp.fc1": colwise,
        "blocks.*.mlp.fc2": rowwise,
        "head": colwise,
    }
    return plan, ["head"]


def check_gpt(model: nn.Module, degree: int, flag: str = "--strategy tp: the world size"
              ) -> None:
    """The demo GPT can be sharded over ``degree`` tensor-parallel ranks (the launcher ran the
    same heads check before starting any rank: cli/mesh_args.py)."""
    cfg = model.cfg
    problem = heads_problem(cfg.n_head, degree, flag)
    if problem:
        raise ValueError(problem)
    if cfg.tie_weights:
        raise ValueError("--strategy tp: tied embedding and head weights are not supported")


def build(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
          device: torch.device) -> Prepared:
    world = dist.get_world_size(group)
    check_gpt(model, world)
    model.to(device)  # before sharding: see [Note: how a sharded parameter appears]
    plan, gathered = gpt_plan(group)
    shard_module(model, plan, gather_output=gathered, process_group=group)
    optimizer = make_adamw(model.parameters(), cfg)  # this rank's shards + replicated params

    return Prepared(model, optimizer, data_slice=(0, 1))
