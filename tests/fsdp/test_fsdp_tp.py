"""FSDP x TP (2D): the demo GPT tensor-parallel over mesh["tp"] (shard_module) and then fully
sharded over mesh["dp"], against one process training the plain model on the whole batch.

Every step: the loss (mean over dp ranks) and the gradient norm that
``torch.nn.utils.clip_grad_norm_`` computes over the 2D DTensors (FSDP1's
``clip_grad_norm_`` method for the wrapper; one norm across both axes, small enough a maximum
that every step clips) against the reference's; at the end every
parameter, gathered whole by ``full_tensor()`` from ``state_dict()``. Plus the model-state bytes
each rank holds between steps (HSDP 2x2 and 2D 2x2) against the bound and ``shardwise plan``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise import FullyShardedDataParallel, fully_shard
from shardwise.checkpoint import get_state_dict, set_state_dict
from shardwise.cli.plan import tp_units
from shardwise.cli.strategy_tp import gpt_plan
from shardwise.distributed import init_device_mesh
from shardwise.fsdp import ModuleWrapPolicy, full_state_dict
from shardwise.memory import state_bytes
from shardwise.memory.layouts import MeshLayout, estimate_mesh_state_bytes
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.models.gpt import Block
from shardwise.sharded_tensor import ShardedTensor, ShardingError, shard_module
from tests.fsdp.test_fsdp_training import _reference_backward
from tests.harness import assert_rel_close, rank_slice, run_on_ranks, token_batch

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH = 8
STEPS = 10
RTOL = 1e-5
# TP's row-wise layers add partial products in another order than the dense model; AdamW turns
# such last-bit differences in near-zero gradients into lr-sized ones in a few elements (seen:
# 1.35e-5 of scale in an MLP bias after 10 steps at tp=2), as in tests/sharded_tensor
PARAM_RTOL = 1e-4
MAX_NORM = 0.05  # below every step's gradient norm: clipping acts at every step


def _two_d(dp: int, tp: int, api: str = "fully_shard"):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(CFG)
    plan, gathered = gpt_plan(mesh["tp"].get_group())
    shard_module(model, plan, gather_output=gathered, process_group=mesh["tp"].get_group())
    if api == "wrapper":
        return FullyShardedDataParallel(model, device_mesh=mesh["dp"],
                                        auto_wrap_policy=ModuleWrapPolicy({Block})), mesh
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"]), mesh


def _train_2d(ctx, dp: int, tp: int, api: str):
    model, mesh = _two_d(dp, tp, api)
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    reference = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        x, y = token_batch(step, 1, GLOBAL_BATCH, CFG.seq_len, CFG.vocab_size)
        loss = lm_loss(model(rank_slice(x[0], dp_rank, dp)), rank_slice(y[0], dp_rank, dp))
        loss.backward()
        if api == "wrapper":  # FSDP1's method: ours, over dp and then tp
            total = model.clip_grad_norm_(MAX_NORM)
        else:  # torch's, on the 2D DTensors
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        loss = loss.detach()
        dist.all_reduce(loss)  # every tp rank of a dp rank holds the same loss
        ref_loss = _reference_backward(reference, x, y, 1, dp)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        assert ref_total > MAX_NORM
        assert_rel_close(total, ref_total, RTOL, f"step {step}: gradient norm")
        ours = loss.item() / (dp * tp)
        assert abs(ours - ref_loss.item()) <= RTOL * abs(ref_loss.item()), (step, ours, ref_loss)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = full_state_dict(model)  # gathered over dp and, for TP shards, over tp
    for key, value in reference.state_dict().items():
        assert_rel_close(full[key], value, PARAM_RTOL, key)
    if api == "fully_shard":  # its state dict holds the 2D DTensors, as torch FSDP2 x TP's
        for key, value in model.state_dict().items():
            assert isinstance(value, DTensor) and value.device_mesh.ndim == 2, key
            assert torch.equal(value.full_tensor(), full[key]), key
    return _placements(model)


def _state_round_trip_body(ctx):
    """model.state_dict() (2D DTensors) loads into a freshly built 2D model, which then computes
    the same logits; so do shardwise.checkpoint's get_state_dict / set_state_dict, with the
    AdamW state."""
    model, mesh = _two_d(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = token_batch(0, 1, GLOBAL_BATCH, CFG.seq_len, CFG.vocab_size)
    lm_loss(model(x[0]), y[0]).backward()
    opt.step()
    fresh, _ = _two_d(2, 2)
    with torch.no_grad():
        before = fresh(x[0])
        fresh.load_state_dict(model.state_dict())
        after, expected = fresh(x[0]), model(x[0])
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    assert not torch.equal(before, expected) and torch.equal(after, expected)
    # shardwise.checkpoint's get/set_state_dict: model and AdamW state as 2D DTensors
    model_sd, optim_sd = get_state_dict(model, opt)
    assert all(isinstance(v, DTensor) and v.device_mesh.ndim == 2 for v in model_sd.values())
    other, _ = _two_d(2, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for p, q in zip(opt.param_groups[0]["params"], other_opt.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].to_local(), other_opt.state[q][key].to_local())
    with torch.no_grad():
        assert torch.equal(other(x[0]), expected)


def test_state_dict_of_2d_dtensors_loads_into_a_fresh_2d_model():
    run_on_ranks(4, _state_round_trip_body)


def _placements(model) -> dict[str, tuple]:
    return {n: tuple(p.placements) for n, p in model.named_parameters()}


@pytest.mark.parametrize(("world_size", "dp", "tp"), [(1, 1, 1), (2, 1, 2), (2, 2, 1),
                                                      (4, 2, 2)])
def test_fsdp_over_dp_of_tp_gpt_equals_single_process(world_size, dp, tp):
    placements = run_on_ranks(world_size, _train_2d, dp, tp, "fully_shard")[0]
    if tp > 1:
        qkv, proj = "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight"
        assert placements[qkv] == (_StridedShard(0, split_factor=tp), Shard(0))
        assert placements[proj] == (Shard(0), Shard(1))
        assert placements["blocks.0.ln1.weight"] == (Shard(0), Replicate())


def test_wrapper_over_dp_of_tp_gpt_equals_single_process():
    run_on_ranks(4, _train_2d, 2, 2, "wrapper")


def _live_body(ctx):
    model, _ = _two_d(2, 2)
    st = model.blocks[0].mlp.fc1.weight
    assert isinstance(st, ShardedTensor)
    assert st.dtype == torch.float32 and st.requires_grad  # answered from the slot as it is
    assert "ShardedTensor(size=(128, 32)" in repr(st)
    try:  # between steps the TP shard is itself sharded over dp
        st.local_tensor()
    except ShardingError as err:
        return str(err)
    return None


def test_tp_shard_read_between_steps_names_the_further_sharding():
    message = run_on_ranks(4, _live_body)[0]
    assert "is sharded further" in message and "FSDP" in message


def _hsdp(mesh):
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _memory_body(ctx, layout: str):
    torch.manual_seed(0)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model, mesh_layout = _hsdp(mesh), MeshLayout(4, replicas=2)
    else:
        model, mesh_layout = _two_d(2, 2)[0], MeshLayout(4, tp=2)
    full_model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    for _ in range(2):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: they are counted too
    ours = state_bytes(model, opt)
    full = state_bytes(full_model)
    planned = estimate_mesh_state_bytes(tp_units(full_model), mesh_layout)
    return ours, full, planned, len(list(full_model.parameters()))


@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_state_between_steps_is_a_quarter_and_matches_the_plan(layout):
    """HSDP 2x2 shards over 2 ranks, so each rank holds half the state, like 2D 2x2 holds...
    a quarter: total / (shard x tp) plus padding (one row per parameter and TP shard)."""
    for ours, full, planned, n_params in run_on_ranks(4, _memory_body, layout):
        shard, tp = (2, 1) if layout == "hsdp" else (2, 2)
        pad = 2 * 4 * CFG.vocab_size * n_params  # a padding row is at most vocab fp32s
        assert ours.params <= full.params / (shard * tp) + pad, (ours, full)
        assert ours.grads <= full.params / (shard * tp) + pad, (ours, full)
        # AdamW: two moments per element plus a 4-byte step counter per parameter
        assert ours.optimizer <= 2 * full.params / (shard * tp) + 2 * pad + 4 * n_params
        assert ours.total == pytest.approx(planned.total, rel=0.05), (ours, planned)


def _three_d_body(ctx):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = GPT(CFG)
    plan, gathered = gpt_plan(mesh["tp"].get_group())
    shard_module(model, plan, gather_output=gathered, process_group=mesh["tp"].get_group())
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    try:
        fully_shard(model.blocks[0], mesh=hybrid)
    except ValueError as err:
        return str(err)
    return None


def test_hybrid_sharding_of_tp_shards_is_refused_by_name():
    message = run_on_ranks(4, _three_d_body)[0]
    assert "attn.qkv.weight (and 4 more) are tensor-parallel shards" in message
    assert "hybrid sharding (a 2D FSDP mesh) with tensor parallelism (3D) is not supported" in \
        message


def _unshardable_body(ctx, case: str):
    """TP layouts that FSDP cannot shard further are refused before anything is sharded."""
    from torch import nn
    from torch.distributed.tensor import distribute_tensor

    from shardwise.sharded_tensor import ChunkShardingSpec, shard_parameter

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    lin = nn.Linear(4, 4)
    before = lin.weight.detach().clone()
    if case == "out_of_order":  # chunk 0 on rank 1: no DTensor Shard(0) lays it out so
        spec = ChunkShardingSpec(0, ["rank:1/cpu", "rank:0/cpu"])
        shard_parameter(lin, "weight", spec, process_group=mesh["tp"].get_group())
    else:  # a DTensor on the whole 2D mesh: not a 1D TP parameter
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh,
                                                    [Replicate(), Shard(0)]))
    try:
        fully_shard(lin, mesh=mesh["dp"])
    except ValueError as err:
        unchanged = not hasattr(lin, "_shardwise_fsdp_unit")
        return str(err), unchanged, before.shape
    return None


@pytest.mark.parametrize(("case", "message"), [
    ("out_of_order", "fully_shard: weight is sharded as ChunkShardingSpec"),
    ("two_d", "fully_shard: weight is a DTensor on a 2D mesh (1, 2); FSDP shards parameters "
              "of 1D tensor parallelism"),
])
def test_tp_layouts_fsdp_cannot_shard_further_are_named(case, message):
    result = run_on_ranks(2, _unshardable_body, case)[0]
    assert result is not None, "fully_shard accepted it"
    text, unchanged, _ = result
    assert message in text, text
    assert unchanged
