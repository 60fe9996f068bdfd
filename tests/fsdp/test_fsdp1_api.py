"""torch FSDP1's API on FullyShardedDataParallel, against one process on the unwrapped model.

Each test trains a small GPT (one unit per block) on world sizes 1, 2 and 4 with each rank on
its slice of the batch, and the single-process reference on the whole batch, then checks:
``summon_full_params`` (whole values, writeback or not, rank0_only, with_grads),
``state_dict_type`` FULL / SHARDED / LOCAL (with torch's enum and configs), name-keyed optimizer
state dicts (full equal to the reference optimizer's state; sharded as DTensor rows; save and
load round trips, including into a plain optimizer), and ``register_comm_hook``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullOptimStateDictConfig as TorchFullOptimConfig
from torch.distributed.fsdp import FullStateDictConfig as TorchFullConfig
from torch.distributed.fsdp import ShardedStateDictConfig as TorchShardedConfig
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.tensor import DTensor, Shard

from shardwise import FullyShardedDataParallel as FSDP
from shardwise.fsdp import (
    FullStateDictConfig,
    OptimStateKeyType,
    StateDictType,
    transformer_auto_wrap_policy,
)
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.models.gpt import Block
from tests.harness import (
    WORLD_SIZES,
    assert_rel_close,
    rank_slice,
    run_on_ranks,
    shard0_rows,
    token_batch,
)

CFG = GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, d_model=12)  # uneven over 4
BATCH = 8
RTOL = 1e-5
POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _models(**kwargs):
    torch.manual_seed(0)
    reference = GPT(CFG)
    torch.manual_seed(0)
    return reference, FSDP(GPT(CFG), auto_wrap_policy=POLICY, **kwargs)


def _step(model, reference, ctx, step, opts=None):
    """One forward/backward (and optimizer step if ``opts``) on both models."""
    x, y = token_batch(step, 1, BATCH, CFG.seq_len, CFG.vocab_size)
    xr, yr = rank_slice(x[0], ctx.rank, ctx.world_size), rank_slice(y[0], ctx.rank,
                                                                    ctx.world_size)
    lm_loss(model(xr), yr).backward()
    lm_loss(reference(x[0]), y[0]).backward()
    if opts:
        for opt in opts:
            opt.step()
            opt.zero_grad()


# ---- summon_full_params ---------------------------------------------------------------------
def _summon(ctx):
    reference, model = _models()
    _step(model, reference, ctx, 0)
    ref = dict(reference.named_parameters())
    with FSDP.summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            assert type(p) is torch.nn.Parameter and not isinstance(p, DTensor), name
            assert_rel_close(p, ref[name], 0.0, name)
            assert_rel_close(p.grad, ref[name].grad, RTOL, f"grad {name}")
    for _, p in model.named_parameters():
        assert isinstance(p, DTensor)
    # writeback: a change made inside persists in the shards; writeback=False discards it
    with FSDP.summon_full_params(model), torch.no_grad():
        model.module.blocks[1].mlp.fc1.weight.fill_(0.5)
        model.module.head.weight.mul_(2.0)
    with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        model.module.ln_f.weight.fill_(7.0)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    assert torch.equal(state["blocks.1.mlp.fc1.weight"],
                       torch.full_like(ref["blocks.1.mlp.fc1.weight"], 0.5))
    assert_rel_close(state["head.weight"], 2 * ref["head.weight"], 0.0, "head")
    assert_rel_close(state["ln_f.weight"], ref["ln_f.weight"], 0.0, "ln_f (discarded)")
    # rank0_only: only rank 0 sees whole parameters; recurse=False: only the root unit's
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        head = model.module.head.weight
        assert isinstance(head, DTensor) == (ctx.rank != 0)  # others keep their shards
        if ctx.rank == 0:
            assert head.device.type == "cpu"
            assert_rel_close(head, 2 * ref["head.weight"], 0.0, "rank0_only head")
    with FSDP.summon_full_params(model, recurse=False):
        assert not isinstance(model.module.head.weight, DTensor)
        assert isinstance(model.module.blocks[0].mlp.fc1.weight, DTensor)
    with (pytest.raises(ValueError, match="rank0_only=True, writeback=True"),
          FSDP.summon_full_params(model, rank0_only=True)):
        pass
    # training goes on normally afterwards, still equal to the reference
    with torch.no_grad():
        reference.blocks[1].mlp.fc1.weight.fill_(0.5)
        reference.head.weight.mul_(2.0)
    _step(model, reference, ctx, 1)
    with FSDP.summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            assert_rel_close(p.grad, ref[name].grad, RTOL, f"second grad {name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_summon_full_params(world_size):
    run_on_ranks(world_size, _summon)


# ---- model state dicts ----------------------------------------------------------------------
def _model_state_dicts(ctx, torch_types):
    types = TorchStateDictType if torch_types else StateDictType
    full_config = TorchFullConfig if torch_types else FullStateDictConfig
    reference, model = _models()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _step(model, reference, ctx, 0, [opt, ref_opt])
    ref = reference.state_dict()
    cfg = full_config(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, types.FULL_STATE_DICT, cfg):
        full = model.state_dict()
    if ctx.rank == 0:
        assert list(full) == list(ref)
        for key, value in ref.items():
            assert not isinstance(full[key], DTensor) and full[key].device.type == "cpu"
            assert_rel_close(full[key], value, RTOL, key)
    else:
        assert full == {}
    sharded_config = TorchShardedConfig() if torch_types else None
    with FSDP.state_dict_type(model, types.SHARDED_STATE_DICT, sharded_config):
        sharded = model.state_dict()
        for key, value in ref.items():
            if key.endswith(".mask") or "attn.bias" in key:
                continue
            if isinstance(sharded[key], DTensor):
                assert sharded[key].placements == (Shard(0),)
                assert_rel_close(sharded[key].to_local(),
                                 shard0_rows(value, ctx.rank, ctx.world_size), RTOL, key)
        assert any(isinstance(v, DTensor) for v in sharded.values())
        sharded = {k: v.detach().clone() for k, v in sharded.items()}
    # the default is FULL again after the block
    assert FSDP.get_state_dict_type(model).state_dict_type is StateDictType.FULL_STATE_DICT
    with FSDP.state_dict_type(model, types.LOCAL_STATE_DICT):
        local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert sorted(k for k in local if k.endswith("_flat_param")) == [
        "_flat_param", "blocks.0._flat_param", "blocks.1._flat_param"]
    # load each into a fresh model (perturbed first): equal to the reference again
    for kind, saved in ((types.SHARDED_STATE_DICT, sharded), (types.LOCAL_STATE_DICT, local)):
        _, fresh = _models()
        with FSDP.state_dict_type(fresh, kind):
            fresh.load_state_dict(saved)
        for key, value in fresh.state_dict().items():
            assert_rel_close(value, ref[key], RTOL, f"{kind.name} {key}")
    # whole tensors under FULL_STATE_DICT (the plain model's state dict) load too
    _, fresh = _models()
    prev = FSDP.set_state_dict_type(fresh, types.FULL_STATE_DICT,
                                    full_config(rank0_only=False))
    assert prev.state_dict_type is StateDictType.FULL_STATE_DICT
    fresh.load_state_dict(ref)
    for key, value in fresh.state_dict().items():
        assert_rel_close(value, ref[key], 0.0, key)
    with pytest.raises(TypeError, match="expected a FullStateDictConfig"):
        FSDP.set_state_dict_type(fresh, types.FULL_STATE_DICT, TorchShardedConfig())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("torch_types", [True, False])
def test_state_dict_types(world_size, torch_types):
    run_on_ranks(world_size, _model_state_dicts, torch_types)


# ---- optimizer state dicts ------------------------------------------------------------------
def _adam(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _optim_save(ctx):
    reference, model = _models()
    opt, ref_opt = _adam(model.parameters()), _adam(reference.parameters())
    for step in range(2):
        _step(model, reference, ctx, step, [opt, ref_opt])
    names = {id(p): n for n, p in reference.named_parameters()}
    ref_state = {names[id(p)]: s for p, s in ref_opt.state.items()}
    with FSDP.state_dict_type(model, TorchStateDictType.FULL_STATE_DICT,
                              TorchFullConfig(rank0_only=True),
                              TorchFullOptimConfig(rank0_only=True)):
        full = FSDP.optim_state_dict(model, opt)
    legacy = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    if ctx.rank == 0:
        for osd in (full, legacy):
            assert osd["param_groups"][0]["params"] == [n for n, _ in
                                                       reference.named_parameters()]
            assert osd["param_groups"][0]["lr"] == 1e-2
            for name, state in ref_state.items():
                for key in ("exp_avg", "exp_avg_sq"):
                    assert not isinstance(osd["state"][name][key], DTensor)
                    assert_rel_close(osd["state"][name][key], state[key], 1e-4, name + key)
                assert float(osd["state"][name]["step"]) == 2.0
    else:
        assert full == {}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, opt)
    for name, state in ref_state.items():
        value = sharded["state"][name]["exp_avg"]
        assert isinstance(value, DTensor) and value.placements == (Shard(0),)
        assert_rel_close(value.to_local(), shard0_rows(state["exp_avg"], ctx.rank,
                                                       ctx.world_size), 1e-4, name)
    # load each into a fresh model and optimizer: the next step equals the reference's
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model_state = model.state_dict()
    legacy = _clone(legacy)
    sharded = _clone(sharded)
    _step(model, reference, ctx, 2, [opt, ref_opt])
    after = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for kind, saved in ((StateDictType.FULL_STATE_DICT, legacy),
                        (StateDictType.SHARDED_STATE_DICT, sharded)):
        _, fresh = _models()
        fresh_opt = _adam(fresh.parameters())
        fresh.load_state_dict(model_state)
        with FSDP.state_dict_type(fresh, kind):
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, saved))
        _step(fresh, _models()[0], ctx, 2, [fresh_opt])
        with FSDP.summon_full_params(fresh):
            for name, p in fresh.named_parameters():
                assert_rel_close(p, after[name], 1e-4, f"{kind.name} resumed {name}")
    return legacy if ctx.rank == 0 else None, model_state, after


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_optim_state_dict_round_trips(world_size):
    full, model_state, after = run_on_ranks(world_size, _optim_save)[0]
    # the full state saved at this world size loads into a plain optimizer on one process
    for via in ("to_load", "rekey"):
        saved = copy.deepcopy(full)  # a plain optimizer keeps the loaded tensors and steps them
        torch.manual_seed(0)
        plain = GPT(CFG)
        plain.load_state_dict(model_state)
        opt = _adam(plain.parameters())
        if via == "to_load":
            opt.load_state_dict(FSDP.optim_state_dict_to_load(plain, opt, saved))
        else:
            opt.load_state_dict(FSDP.rekey_optim_state_dict(saved, OptimStateKeyType.PARAM_ID,
                                                            plain))
        x, y = token_batch(2, 1, BATCH, CFG.seq_len, CFG.vocab_size)
        lm_loss(plain(x[0]), y[0]).backward()
        opt.step()
        for name, p in plain.named_parameters():
            assert_rel_close(p, after[name], 1e-4, f"plain {via} {name}")


def _optim_rank0_only(ctx):
    """Only rank 0 holds the full optimizer state: FullOptimStateDictConfig(rank0_only=True)
    when loading, and scatter_full_optim_state_dict, send it to the others."""
    reference, model = _models()
    opt, ref_opt = _adam(model.parameters()), _adam(reference.parameters())
    _step(model, reference, ctx, 0, [opt, ref_opt])
    cfg = TorchFullOptimConfig(rank0_only=True)
    with FSDP.state_dict_type(model, TorchStateDictType.FULL_STATE_DICT,
                              TorchFullConfig(rank0_only=False), cfg):
        model_state = model.state_dict()
        saved = FSDP.optim_state_dict(model, opt)  # collective; {} on ranks other than 0
    saved = _clone(saved) if ctx.rank == 0 else saved
    _step(model, reference, ctx, 1, [ref_opt])
    after = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for via in ("rank0_only", "scatter"):
        _, fresh = _models()
        fresh.load_state_dict(model_state)
        fresh_opt = _adam(fresh.parameters())
        mine = copy.deepcopy(saved) if ctx.rank == 0 else None
        if via == "scatter":
            loaded = FSDP.scatter_full_optim_state_dict(mine, fresh, optim=fresh_opt)
        else:
            with FSDP.state_dict_type(fresh, TorchStateDictType.FULL_STATE_DICT,
                                      TorchFullConfig(), cfg):
                loaded = FSDP.optim_state_dict_to_load(fresh, fresh_opt, mine or {})
        fresh_opt.load_state_dict(loaded)
        assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)
        _step(fresh, _models()[0], ctx, 1, [fresh_opt])
        with FSDP.summon_full_params(fresh):
            for name, p in fresh.named_parameters():
                assert_rel_close(p, after[name], 1e-4, f"{via} resumed {name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_optim_state_from_rank0_only(world_size):
    run_on_ranks(world_size, _optim_rank0_only)


def _clone(osd):
    return {"state": {k: {n: v.detach().clone() if isinstance(v, torch.Tensor) else v
                          for n, v in s.items()} for k, s in osd["state"].items()},
            "param_groups": osd["param_groups"]}


# ---- register_comm_hook ---------------------------------------------------------------------
class _SumState:
    def __init__(self, group, scale):
        self.group, self.scale, self.calls = group, scale, 0


def _scaled_sum_hook(state, grad, output):
    """Sum (not mean) over ranks, times ``scale``: built from all_reduce and a slice."""
    state.calls += 1
    total = grad.clone()
    dist.all_reduce(total, group=state.group)
    world, rank = dist.get_world_size(state.group), dist.get_rank(state.group)
    output.copy_(total.view(world, -1)[rank] * state.scale)


def _reduce_scatter_single(output, grad, group=None):
    """gloo has no reduce_scatter_tensor; what torch's default hook calls, for the test."""
    total = grad.clone()
    dist.all_reduce(total, group=group)
    output.copy_(total.view(dist.get_world_size(group), -1)[dist.get_rank(group)])


# the flat reduce-scatter torch's reduce_scatter_hook calls: renamed in torch 2.13
_TORCH_HOOK_CALLS = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                     else "reduce_scatter_tensor")


def _comm_hook(ctx, which):
    from torch.distributed.algorithms._comm_hooks import default_hooks

    reference, model = _models()
    if which == "scaled_sum":
        state, hook, factor = _SumState(ctx.group, 0.5), _scaled_sum_hook, 0.5 * ctx.world_size
    else:  # torch's own hook: averages with pre/post division factors
        state, hook, factor = default_hooks.DefaultState(ctx.group), None, 1.0
        hook = default_hooks.reduce_scatter_hook
        saved = getattr(dist, _TORCH_HOOK_CALLS)
        setattr(dist, _TORCH_HOOK_CALLS, _reduce_scatter_single)
    try:
        model.register_comm_hook(state, hook)
        with pytest.raises(RuntimeError, match="already registered"):
            model.register_comm_hook(state, hook)
        _step(model, reference, ctx, 0)
    finally:
        if which != "scaled_sum":
            setattr(dist, _TORCH_HOOK_CALLS, saved)
    if which == "scaled_sum":
        assert state.calls == 3  # one per unit: two blocks and the root
    with FSDP.summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            expected = dict(reference.named_parameters())[name].grad * factor
            assert_rel_close(p.grad, expected, RTOL, name)
    with pytest.raises(RuntimeError, match="before the first forward"):
        model.register_comm_hook(state, hook)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("which", ["scaled_sum", "torch_reduce_scatter_hook"])
def test_register_comm_hook(world_size, which):
    run_on_ranks(world_size, _comm_hook, which)
