"""torch FSDP2 programs, written the way torch's docs and examples write them, run twice: once
with ``torch.distributed.fsdp`` and once with the imports swapped to ``shardwise``. The results
must agree with each other (and, where no random init on shards is involved, with one process
training the unwrapped model).

The idioms: meta-device init (build on ``meta``, ``fully_shard`` each layer and the root,
``to_empty``, ``reset_parameters``), ``MixedPrecisionPolicy``, explicit prefetch with
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, ``FSDPModule``
methods, ``torch.nn.utils.clip_grad_norm_`` on the sharded model, and DCP's
``get_model_state_dict`` / ``set_model_state_dict`` / optimizer state dicts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from tests.compat.models import Transformer
from tests.compat.models import batch as _batch
from tests.harness import WORLD_SIZES, assert_rel_close, reference_train, run_on_ranks

RTOL = 1e-5


def _api(impl: str):
    """``(fully_shard, FSDPModule, MixedPrecisionPolicy)`` of torch or of shardwise."""
    if impl == "torch":
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    else:
        from shardwise import FSDPModule, MixedPrecisionPolicy, fully_shard
    return fully_shard, FSDPModule, MixedPrecisionPolicy


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _shard(model, fully_shard, **kwargs):
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _train(model, ctx, steps, clip=None):
    """AdamW steps; returns per-step (mean loss over ranks, clip norm or None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(steps):
        x, y, _, _ = _batch(step, ctx.rank, ctx.world_size)
        loss = _loss(model, x, y)
        loss.backward()
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            norm = float(norm)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append((mean.item() / ctx.world_size, norm))
    return out


def _reference(full_state: dict, ctx, steps, clip=None):
    """One process, the unwrapped model from ``full_state``, on the global batch."""
    def loaded():
        model = Transformer()
        model.load_state_dict(full_state)
        return model

    def loss(model, step):
        _, _, x, y = _batch(step, 0, ctx.world_size)
        return _loss(model, x, y)

    run = reference_train(loaded, loss, lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1), steps, seed=None, clip=clip)
    return list(zip(run.losses, run.norms or [None] * steps))


def _full_state(model) -> dict:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    # cloned: on one rank the gathered tensors may share storage with the live parameters
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}


def _meta_init_program(ctx, impl):
    """FSDP2's documented meta-device init, then training with gradient clipping."""
    fully_shard, FSDPModule, _ = _api(impl)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    _shard(model, fully_shard)
    assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
    model.to_empty(device="cpu")
    torch.manual_seed(ctx.rank + 7)
    model.reset_parameters()
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), type(p)
    init = _full_state(model)
    losses = _train(model, ctx, 4, clip=0.5)
    return init, losses, _reference(init, ctx, 4, clip=0.5)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_meta_device_init_trains_like_torch_and_like_one_process(world_size):
    ours = run_on_ranks(world_size, _meta_init_program, "shardwise")
    torch_ = run_on_ranks(world_size, _meta_init_program, "torch")
    for rank in range(world_size):
        init, losses, reference = ours[rank]
        torch_init, torch_losses, _ = torch_[rank]
        for key, value in torch_init.items():  # same local shapes, same RNG: same init
            assert_rel_close(init[key], value, 0.0, f"init {key}")
        for step, ((loss, norm), (ref_loss, ref_norm), (t_loss, t_norm)) in enumerate(
                zip(losses, reference, torch_losses)):
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (step, loss, ref_loss)
            assert abs(loss - t_loss) <= RTOL * abs(t_loss), (step, loss, t_loss)
            # clip_grad_norm_ on the sharded model returns the global norm on every rank
            assert abs(norm - ref_norm) <= RTOL * ref_norm, (step, norm, ref_norm)
            assert abs(norm - t_norm) <= RTOL * t_norm, (step, norm, t_norm)


def _seeded_full_state() -> dict:
    torch.manual_seed(0)
    return Transformer().state_dict()


def _policy_program(ctx, impl, variant):
    """Mixed precision, explicit prefetch, and the FSDPModule setters, from a full state dict
    loaded with ``set_model_state_dict(broadcast_from_rank0=True)``."""
    fully_shard, FSDPModule, MixedPrecisionPolicy = _api(impl)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    kwargs = {}
    if variant == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if variant == "no_reshard":
        kwargs["reshard_after_forward"] = False
    _shard(model, fully_shard, **kwargs)
    model.to_empty(device="cpu")
    full = _seeded_full_state() if ctx.rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    if variant == "prefetch":
        layers = list(model.layers)
        for i, layer in enumerate(layers[:-1]):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        for i, layer in enumerate(layers[1:], start=1):
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    if variant == "unshard":
        model.unshard()  # the documented way to gather before the first forward
    return _train(model, ctx, 3)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("variant", ["bf16", "prefetch", "no_reshard", "unshard"])
def test_fsdp2_options_match_torch(world_size, variant):
    ours = run_on_ranks(world_size, _policy_program, "shardwise", variant)[0]
    theirs = run_on_ranks(world_size, _policy_program, "torch", variant)[0]
    # bf16: both compute in bf16 with fp32 reduction; the order of bf16 roundings may differ
    tol = 2e-3 if variant == "bf16" else RTOL
    for (loss, _), (t_loss, _) in zip(ours, theirs):
        assert abs(loss - t_loss) <= tol * abs(t_loss), (variant, ours, theirs)


def _dcp_program(ctx, impl):
    """Sharded model and optimizer state dicts through DCP's helpers: save after two steps,
    load into a fresh model, and continue identically."""
    fully_shard, _, _ = _api(impl)
    model = _shard(_loaded(), fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y, _, _ = _batch(step, ctx.rank, ctx.world_size)
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt)
    kinds = {type(v).__name__ for v in msd.values()}
    msd = {k: v.detach().clone() for k, v in msd.items()}
    osd = _clone(osd)
    fresh = _shard(Transformer(), fully_shard)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    set_model_state_dict(fresh, msd)
    set_optimizer_state_dict(fresh, fresh_opt, osd)
    x, y, _, _ = _batch(5, ctx.rank, ctx.world_size)
    losses = []
    for net, o in ((model, opt), (fresh, fresh_opt)):
        _loss(net, x, y).backward()
        o.step()
        losses.append(_loss(net, x, y).item())
    return kinds, losses, _full_state(fresh)


def _loaded():
    model = Transformer()
    model.load_state_dict(_seeded_full_state())
    return model


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dcp_state_dicts_round_trip_like_torch(world_size):
    ours = run_on_ranks(world_size, _dcp_program, "shardwise")[0]
    theirs = run_on_ranks(world_size, _dcp_program, "torch")[0]
    assert ours[0] == theirs[0] == {"DTensor"}
    (a, b), (ta, tb) = ours[1], theirs[1]
    assert a == b and ta == tb, "loaded model and optimizer continue exactly like the saved"
    assert abs(a - ta) <= RTOL * abs(ta)
    for key, value in theirs[2].items():
        assert_rel_close(ours[2][key], value, RTOL, key)


def _torch_isinstance_program(ctx):
    """What third-party code does with an FSDP2 module: ``isinstance`` against torch's class,
    then torch's methods."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from shardwise import fully_shard

    model = _shard(_loaded(), fully_shard)
    seq = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    held = [isinstance(m, TorchFSDPModule) for m in (model, model.layers[0], seq)]
    # a container building a new instance of its own class gets the original class
    sliced = type(seq[0:1]).__name__
    # every method of torch's class is ours or refused: none runs torch's code on our module
    torch_code = sorted(n for n, f in vars(TorchFSDPModule).items()
                        if callable(f) and not n.startswith("__")
                        and getattr(type(model), n) is f)
    model.unshard()  # torch's method names, our implementations
    model.reshard()
    model.set_requires_gradient_sync(True)
    model.set_reduce_scatter_unused_params(True)  # ours: zero gradients for unused parameters
    model.set_reduce_scatter_unused_params(False)  # and back to None for them, torch's default
    errors = {}
    for name, args in (("set_all_reduce_hook", (None,)), ("_get_fsdp_state", ()),
                       ("set_custom_all_gather", (None,))):
        try:
            getattr(model, name)(*args)
        except NotImplementedError as e:
            errors[name] = str(e)
    x, y, _, _ = _batch(0, ctx.rank, ctx.world_size)
    loss = _loss(model, x, y).item()  # still trains after all that
    return held, sliced, torch_code, errors, loss


def test_our_fsdp_modules_are_torch_fsdp_modules_and_refuse_torch_only_methods():
    held, sliced, torch_code, errors, loss = run_on_ranks(2, _torch_isinstance_program)[0]
    assert held == [True, True, True]
    assert sliced == "Sequential"
    assert torch_code == [], torch_code
    assert set(errors) == {"set_all_reduce_hook", "_get_fsdp_state",
                           "set_custom_all_gather"}
    assert "FSDPModule.set_all_reduce_hook" in errors["set_all_reduce_hook"]
    assert "own collectives" in errors["set_all_reduce_hook"]
    assert "pipelining" in errors["_get_fsdp_state"]
    assert loss == loss  # a number: the module still runs
