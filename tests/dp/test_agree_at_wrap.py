"""Ranks that built different models get a named error on every rank when a data-parallel
mechanism wraps them, before any collective relies on the layout (issue 14)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    ZeroRedundancyOptimizer,
    fully_shard,
)
from shardwise.dp.agree import ModelMismatchError
from tests.harness import run_on_ranks


def _model(rank: int, case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "transposed":  # same element count, other shape: DDP used to train silently
        return nn.Sequential(nn.Linear(4, 6) if rank == 0 else nn.Linear(6, 4))
    return nn.Sequential(nn.Linear(4, 4 if rank == 0 else 5))  # gloo used to abort here


def _wrap(ctx, mechanism: str, case: str):
    model = _model(ctx.rank, case)
    with pytest.raises(ModelMismatchError) as err:
        if mechanism == "ddp":
            DistributedDataParallel(model)
        elif mechanism == "fully_shard":
            fully_shard(model)
        elif mechanism == "fsdp1":
            FullyShardedDataParallel(model, sync_module_states=True)
        else:
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    return str(err.value)


@pytest.mark.parametrize("mechanism", ["ddp", "fully_shard", "fsdp1", "zero"])
@pytest.mark.parametrize("case", ["transposed", "wider"])
def test_mismatched_models_are_named_on_every_rank(mechanism, case):
    messages = run_on_ranks(2, _wrap, mechanism, case)
    assert messages[0] == messages[1]  # the same error on every rank
    assert "rank(s) [1] differ from rank 0" in messages[0]
    assert "0.weight" in messages[0] or "params[0]" in messages[0]
