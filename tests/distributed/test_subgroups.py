"""Every data-parallel mechanism on a subgroup while the other ranks train in their own group.

World size 4: ranks {0, 2} and {1, 3} each train their own copy of the demo GPT (a different
seed and different data per group) at the same time, with DDP, ZeRO stage 1, ZeRO stage 2 and
FSDP (``process_group=`` and, for DDP and FSDP, a 1D mesh of the group), and tensor parallelism
(``shard_module`` over the group). Each group's losses and final parameters equal one process
training its copy on the group's global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import shardwise.sharded_tensor as st
from shardwise import (
    DistributedDataParallel,
    ZeroDataParallel,
    ZeroRedundancyOptimizer,
    fully_shard,
)
from shardwise.fsdp import full_state_dict
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.fsdp.test_fsdp_training import _reference_backward
from tests.harness import assert_rel_close, rank_slice, run_on_ranks, token_batch

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
GROUPS = ([0, 2], [1, 3])
STEPS = 4
RTOL = 1e-5


def _wrap(model, kind: str, group: dist.ProcessGroup):
    mesh = DeviceMesh.from_group(group, "cpu")
    if kind in ("ddp", "ddp_mesh", "zero1"):
        ddp = (DistributedDataParallel(model, device_mesh=mesh) if kind == "ddp_mesh"
               else DistributedDataParallel(model, process_group=group))
        opt = (ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                       lr=1e-3, process_group=group) if kind == "zero1"
               else torch.optim.AdamW(ddp.parameters(), lr=1e-3))
        return ddp, opt
    if kind == "zero2":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3, process_group=group)
        return ZeroDataParallel(model, opt), opt
    if kind == "tp":
        ranks = dist.get_process_group_ranks(group)  # placements name global ranks
        col, row = st.ChunkShardingSpec(0, ranks), st.ChunkShardingSpec(1, ranks)
        plan = {"blocks.*.mlp.fc1": col, "blocks.*.mlp.fc2": row}
        st.shard_module(model, plan, process_group=group)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    for block in model.blocks:
        fully_shard(block, mesh=mesh) if kind == "fsdp_mesh" else fully_shard(
            block, process_group=group)
    fully_shard(model, mesh=mesh) if kind == "fsdp_mesh" else fully_shard(
        model, process_group=group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _full_params(model, kind: str) -> dict:
    if kind.startswith("fsdp"):
        return full_state_dict(model)
    if kind == "tp":
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for k, v in model.state_dict().items()}
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _train_in_subgroup(ctx, kind: str):
    groups = [dist.new_group(g) for g in GROUPS]  # every rank makes every group
    index = 0 if ctx.rank in GROUPS[0] else 1
    group = groups[index]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(10 + index)
    reference = GPT(CFG)
    torch.manual_seed(10 + index)
    model, opt = _wrap(GPT(CFG), kind, group)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    tp = kind == "tp"  # tensor parallelism: every rank of the group sees the whole batch
    for step in range(STEPS):
        x, y = token_batch(100 * index + step, 1, 4, CFG.seq_len, CFG.vocab_size)
        xr = x[0] if tp else rank_slice(x[0], rank, world)
        yr = y[0] if tp else rank_slice(y[0], rank, world)
        loss = lm_loss(model(xr), yr)
        loss.backward()
        ref_loss = _reference_backward(reference, x, y, 1, 1 if tp else world)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        mean = mean.item() / world
        assert abs(mean - ref_loss.item()) <= RTOL * abs(ref_loss.item()), (step, mean)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    state = _full_params(model, kind)
    for key, value in reference.state_dict().items():
        assert_rel_close(state[key], value, RTOL, f"{kind} group {GROUPS[index]}: {key}")
    for g in groups:
        dist.destroy_process_group(g)


@pytest.mark.parametrize("kind", ["ddp", "ddp_mesh", "zero1", "zero2", "fsdp", "fsdp_mesh",
                                  "tp"])
def test_mechanism_on_a_subgroup_beside_another_group(kind):
    run_on_ranks(4, _train_in_subgroup, kind)
