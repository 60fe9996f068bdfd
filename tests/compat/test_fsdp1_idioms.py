"""torch FSDP1 programs, written in the idioms of torch's docs, run twice: once with
``torch.distributed.fsdp.FullyShardedDataParallel`` and once with the import swapped to
``shardwise``. Losses, state dicts and optimizer state dicts must agree with each other and with
one process training the unwrapped model on the whole batch.

The idioms: ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})``
and ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``;
``summon_full_params`` to edit parameters in place; saving with
``state_dict_type(FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))``
and ``FSDP.optim_state_dict``; resuming with ``load_state_dict`` and
``FSDP.optim_state_dict_to_load``; the same through SHARDED_STATE_DICT.

Running torch's FSDP1 on CPU: it refuses ("FSDP needs a non-CPU accelerator device") only when
it has to guess the device; passing ``device_id=torch.device("cpu")`` (in both programs) skips
the guess and it runs on gloo. One exception: torch's ``FullStateDictConfig(offload_to_cpu=True)``
crashes the process on CPU (segmentation fault while cloning the gathered parameters), so
torch's program saves with ``offload_to_cpu=False`` there (on CPU it has nothing to move) and
ours with the documented ``offload_to_cpu=True``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.compat.models import Layer, Transformer
from tests.compat.models import batch as _batch
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

ADAM_RTOL = 1e-4  # Adam's update divides by sqrt(v): tiny reduction-order differences grow


def _api(impl: str) -> dict:
    """The names an FSDP1 program imports, from torch or from shardwise."""
    if impl == "torch":
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import (
            size_based_auto_wrap_policy,
            transformer_auto_wrap_policy,
        )
    else:
        from shardwise.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
            size_based_auto_wrap_policy,
            transformer_auto_wrap_policy,
        )
        from shardwise.fsdp import FullyShardedDataParallel as FSDP
    return dict(FSDP=FSDP, FullOptimStateDictConfig=FullOptimStateDictConfig,
                FullStateDictConfig=FullStateDictConfig, StateDictType=StateDictType,
                size_based_auto_wrap_policy=size_based_auto_wrap_policy,
                transformer_auto_wrap_policy=transformer_auto_wrap_policy)


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer()


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(model, opt, ctx, steps, first=0):
    """Mean loss over ranks of each step."""
    out = []
    for step in range(first, first + steps):
        x, y, _, _ = _batch(step, ctx.rank, ctx.world_size)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append(mean.item() / ctx.world_size)
    return out


def _adam(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _policy(api: dict, which: str):
    if which == "transformer":
        return functools.partial(api["transformer_auto_wrap_policy"],
                                 transformer_layer_cls={Layer})
    return functools.partial(api["size_based_auto_wrap_policy"], min_num_params=2000)


def _edit(model, FSDP):
    """The documented way to change parameters outside forward: edit the whole values inside
    summon_full_params (written back to the shards on exit)."""
    with FSDP.summon_full_params(model), torch.no_grad():
        model.module.norm.weight.fill_(1.5)
        model.module.layers[1].w2.weight.mul_(0.5)


def _full_program(ctx, impl, which):
    """Train, edit, save full state (rank 0), resume in a fresh model from the full state."""
    api = _api(impl)
    FSDP, types = api["FSDP"], api["StateDictType"]
    cpu = torch.device("cpu")
    model = FSDP(_model(), auto_wrap_policy=_policy(api, which), device_id=cpu)
    opt = _adam(model.parameters())
    losses = _train(model, opt, ctx, 3)
    _edit(model, FSDP)
    save_cfg = api["FullStateDictConfig"](offload_to_cpu=impl != "torch", rank0_only=True)
    optim_cfg = api["FullOptimStateDictConfig"](offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, types.FULL_STATE_DICT, save_cfg, optim_cfg):
        state = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    if ctx.rank != 0:
        assert state == {} and osd == {}
    # every rank loads the full checkpoint (here: rank 0's, as if read from one file)
    state, osd = _from_rank0(state, osd)
    fresh = FSDP(_model(), auto_wrap_policy=_policy(api, which), device_id=cpu)
    fresh_opt = _adam(fresh.parameters())
    load_cfg = api["FullStateDictConfig"](rank0_only=False)
    with FSDP.state_dict_type(fresh, types.FULL_STATE_DICT, load_cfg,
                              api["FullOptimStateDictConfig"](rank0_only=False)):
        fresh.load_state_dict(state)
        fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
    resumed = _train(fresh, fresh_opt, ctx, 2, first=3)
    return losses, resumed, state, osd


def _from_rank0(state: dict, osd: dict) -> tuple[dict, dict]:
    """Rank 0's full state dicts on every rank: tensors broadcast into same-shaped buffers
    (the structure is the same on every rank, so no objects cross processes)."""
    template = _model()
    full_state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    if dist.get_rank() == 0:
        full_state = {k: v.detach().clone() for k, v in state.items()}
    for value in full_state.values():
        dist.broadcast(value, 0)
    opt = _adam(template.parameters())
    for p in template.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialize a state of the right structure
    names = [n for n, _ in template.named_parameters()]
    skeleton = {"state": {names[i]: {k: v.clone() for k, v in s.items()}
                          for i, s in opt.state_dict()["state"].items()},
                "param_groups": [{**g, "params": names} for g in opt.state_dict()["param_groups"]]}
    if dist.get_rank() == 0:
        skeleton = {"state": {k: {n: v.clone() for n, v in s.items()}
                              for k, s in osd["state"].items()},
                    "param_groups": osd["param_groups"]}
    for name in names:
        for key in sorted(skeleton["state"][name]):
            dist.broadcast(skeleton["state"][name][key], 0)
    return full_state, skeleton


def _reference(ctx, world, steps_before, steps_after):
    """One process: the unwrapped model on the whole batch of ``world`` ranks; after
    ``steps_before`` steps the same edit, and the state and optimizer state are recorded."""
    model = _model()
    opt = _adam(model.parameters())
    out, state, osd = [], None, None
    for step in range(steps_before + steps_after + 1):
        if step == steps_before:
            with torch.no_grad():
                model.norm.weight.fill_(1.5)
                model.layers[1].w2.weight.mul_(0.5)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            names = {id(p): n for n, p in model.named_parameters()}
            osd = {names[id(p)]: {k: v.clone() for k, v in s.items()}
                   for p, s in opt.state.items()}
        if step == steps_before + steps_after:
            break
        _, _, x, y = _batch(step, 0, world)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out[:steps_before], out[steps_before:], state, osd


@pytest.mark.parametrize(("world_size", "which"), [(w, "transformer") for w in WORLD_SIZES]
                         + [(2, "size")])
def test_full_state_dict_save_and_resume_match_torch(world_size, which):
    ours = run_on_ranks(world_size, _full_program, "shardwise", which)[0]
    theirs = run_on_ranks(world_size, _full_program, "torch", which)[0]
    ref = run_on_ranks(1, _reference, world_size, 3, 2)[0]
    (losses, resumed, state, osd), (t_losses, t_resumed, t_state, t_osd) = ours, theirs
    ref_losses, ref_resumed, ref_state, ref_osd = ref
    for got, want, what in ((losses, t_losses, "torch"), (losses, ref_losses, "reference"),
                            (resumed, t_resumed, "torch resumed"),
                            (resumed, ref_resumed, "reference resumed")):
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= ADAM_RTOL * abs(b), (what, got, want)
    assert list(state) == list(t_state) == list(ref_state)
    for key in ref_state:
        assert_rel_close(state[key], t_state[key], ADAM_RTOL, f"state vs torch {key}")
        assert_rel_close(state[key], ref_state[key], ADAM_RTOL, f"state vs reference {key}")
    # the same names; the order is the optimizer's, which with torch's default
    # use_orig_params=False follows its flat parameters (root unit first), ours the model's
    assert sorted(osd["param_groups"][0]["params"]) == sorted(t_osd["param_groups"][0]["params"])
    assert osd["param_groups"][0]["params"] == list(ref_osd)
    assert set(osd["state"]) == set(t_osd["state"]) == set(ref_osd)
    for name, entry in ref_osd.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_rel_close(osd["state"][name][key], t_osd["state"][name][key], ADAM_RTOL,
                             f"optimizer {name} {key} vs torch")
            assert_rel_close(osd["state"][name][key], entry[key], ADAM_RTOL,
                             f"optimizer {name} {key} vs reference")


def _sharded_program(ctx, impl):
    """Save model and optimizer under SHARDED_STATE_DICT, load into a fresh model, go on."""
    api = _api(impl)
    FSDP, types = api["FSDP"], api["StateDictType"]
    cpu = torch.device("cpu")
    policy = _policy(api, "transformer")
    model = FSDP(_model(), auto_wrap_policy=policy, device_id=cpu)
    opt = _adam(model.parameters())
    losses = _train(model, opt, ctx, 2)
    with FSDP.state_dict_type(model, types.SHARDED_STATE_DICT):
        state = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    fresh = FSDP(_model(), auto_wrap_policy=policy, device_id=cpu)
    fresh_opt = _adam(fresh.parameters())
    with FSDP.state_dict_type(fresh, types.SHARDED_STATE_DICT):
        fresh.load_state_dict(state)
        fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
    return losses + _train(fresh, fresh_opt, ctx, 2, first=2)


@pytest.mark.parametrize("world_size", (2, 4))
def test_sharded_state_dict_resume_matches_torch(world_size):
    ours = run_on_ranks(world_size, _sharded_program, "shardwise")[0]
    theirs = run_on_ranks(world_size, _sharded_program, "torch")[0]
    ref_before, ref_after, _, _ = run_on_ranks(1, _reference, world_size, 4, 0)[0]
    for a, b, c in zip(ours, theirs, ref_before, strict=True):
        assert abs(a - b) <= ADAM_RTOL * abs(b), (ours, theirs)
        assert abs(a - c) <= ADAM_RTOL * abs(c), (ours, ref_before)
