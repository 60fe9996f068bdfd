"""FSDP over torch's tensor parallelism (2D), written as torch's tutorial and torchtitan write it,
run with torch's ``fully_shard`` and with shardwise's; only the FSDP import differs.

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` (torch's or ours), then
``parallelize_module`` over ``mesh["tp"]`` with ``RowwiseParallel`` (embedding),
``SequenceParallel`` (norms), ``PrepareModuleInput``, ``ColwiseParallel`` / ``RowwiseParallel``
(the MLP) and a column-wise head with ``loss_parallel``; then ``fully_shard(block,
mesh=mesh["dp"])`` per block and on the root. Five AdamW steps with torch's
``clip_grad_norm_``: the same losses, norms and parameters as torch's FSDP2. Then DCP saves the
2D state (model and optimizer) and a world of 2 ranks without TP loads it and trains on, again
as torch does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tests.harness import assert_rel_close, reference_train, run_on_ranks

RTOL = 1e-6
D, VOCAB, SEQ, BATCH = 16, 32, 4, 2


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, 2 * D)
        self.w2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.feed_forward = FeedForward()

    def forward(self, x):
        return x + self.feed_forward(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        h = self.tok(ids)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


def _mesh(impl: str, dp: int, tp: int):
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
    else:
        from shardwise.distributed import init_device_mesh
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _fully_shard(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardwise import fully_shard
    return fully_shard


def _parallelize(model: Net, tp_mesh) -> None:
    """torch's 2D tutorial plan: sequence parallel norms, column/row-wise MLP."""
    parallelize_module(model, tp_mesh, {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                               use_local_output=False),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def _batch(step: int, dp_rank: int, dp: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH * 2, SEQ + 1), generator=g)
    mine = ids.chunk(dp)[dp_rank]
    return mine[:, :-1], mine[:, 1:]


def _loss(model, x, y, parallel: bool):
    logits = model(x)
    if parallel:  # logits sharded on the vocabulary over tp
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
    else:
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _steps(model, opt, dp_rank, dp, steps, first, parallel, ours_norm=False):
    out = []
    for step in range(first, first + steps):
        x, y = _batch(step, dp_rank, dp)
        loss = _loss(model, x, y, parallel)
        if ours_norm:  # shardwise's clip_grad_norm_ (here not clipping) sees the same norm
            from shardwise.fsdp import clip_grad_norm_
            check = float(clip_grad_norm_(model.parameters(), float("inf")))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append((mean.item() / dist.get_world_size(), float(norm)))
        if ours_norm:
            assert abs(check - float(norm)) <= RTOL * float(norm), (step, check, float(norm))
    return out


def _full(model) -> dict:
    opts = StateDictOptions(full_state_dict=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}


def _build_2d(impl: str, mesh_impl: str):
    mesh = _mesh(mesh_impl, 2, 2)
    torch.manual_seed(0)
    model = Net()
    _parallelize(model, mesh["tp"])
    if impl == "wrapper":  # FSDP1's API, ours
        from shardwise.fsdp import FullyShardedDataParallel, ModuleWrapPolicy

        return FullyShardedDataParallel(model, device_mesh=mesh["dp"],
                                        auto_wrap_policy=ModuleWrapPolicy({Block})), mesh
    fully_shard = _fully_shard(impl)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _save(api: str, model, opt, path: str) -> None:
    if api == "ours":
        from shardwise.checkpoint import get_state_dict, save

        msd, osd = get_state_dict(model, opt)
        save({"model": msd, "optim": osd}, checkpoint_id=path)
        return
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)


def _load(api: str, model, opt, path: str) -> None:
    if api == "ours":
        from shardwise.checkpoint import get_state_dict, load, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _curve_program(ctx, impl):
    model, mesh = _build_2d(impl, "torch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return _steps(model, opt, mesh["dp"].get_local_rank(), 2, 5, 0, parallel=True)


def _two_d_program(ctx, impl, mesh_impl, ckpt, api):
    model, mesh = _build_2d(impl, mesh_impl)
    layouts = {n: (tuple(p.device_mesh.mesh_dim_names), tuple(p.placements))
               for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp_rank = mesh["dp"].get_local_rank()
    curve = _steps(model, opt, dp_rank, 2, 5, 0, parallel=True, ours_norm=impl == "ours")
    _save(api, model, opt, f"{ckpt}/{impl}")
    return layouts, curve, _full(model)


def _resume_program(ctx, impl, ckpt, api):
    """World size 2, FSDP only (no TP): load the 2D checkpoint and train on."""
    torch.manual_seed(1)  # other initial values: the checkpoint must replace them all
    model = Net()
    fully_shard = _fully_shard(impl)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _load(api, model, opt, f"{ckpt}/{impl}")
    loaded = _full(model)
    curve = _steps(model, opt, ctx.rank, 2, 2, 5, parallel=False, ours_norm=impl == "ours")
    return loaded, curve, _full(model)


def _reference(steps: int) -> list:
    """One process, the plain model on the whole batch (TP adds partial sums in another order:
    a looser tolerance than between the two FSDPs)."""
    def loss(model, step):
        x, y = _batch(step, 0, 1)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    run = reference_train(Net, loss, lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1), steps, clip=0.5)
    return list(zip(run.losses, run.norms))


def _assert_curves(ours, theirs, what, rtol=RTOL):
    for step, ((loss, norm), (t_loss, t_norm)) in enumerate(zip(ours, theirs)):
        assert abs(loss - t_loss) <= rtol * abs(t_loss), (what, step, loss, t_loss)
        assert abs(norm - t_norm) <= rtol * t_norm, (what, step, norm, t_norm)


# (whose init_device_mesh, whose checkpoint API for shardwise's run); torch's run uses torch's
@pytest.mark.parametrize(("mesh_impl", "api"), [("torch", "torch"), ("ours", "ours")])
def test_fsdp_over_torch_tp_trains_saves_and_resumes_like_torch(tmp_path, mesh_impl, api):
    ckpt = str(tmp_path)
    ours = run_on_ranks(4, _two_d_program, "ours", mesh_impl, ckpt, api)
    theirs = run_on_ranks(4, _two_d_program, "torch", mesh_impl, ckpt, "torch")
    for rank in range(4):
        layouts, curve, full = ours[rank]
        t_layouts, t_curve, t_full = theirs[rank]
        assert layouts == t_layouts  # torch's 2D placements, _StridedShard included
        _assert_curves(curve, t_curve, f"2x2 rank {rank}")
        assert full.keys() == t_full.keys()
        for key, value in t_full.items():
            assert_rel_close(full[key], value, RTOL, f"2x2 rank {rank}: {key}")
    _assert_curves(ours[0][1], _reference(5), "against one process", rtol=1e-5)
    placements = {p for _, ps in ours[0][0].values() for p in ps}
    assert any(type(p).__name__ == "_StridedShard" for p in placements)
    assert ours[0][0]["out.weight"][0] == ("dp", "tp")
    saved = ours[0][2]
    ours = run_on_ranks(2, _resume_program, "ours", ckpt, api)
    theirs = run_on_ranks(2, _resume_program, "torch", ckpt, "torch")
    for rank in range(2):
        loaded, curve, full = ours[rank]
        t_loaded, t_curve, t_full = theirs[rank]
        for key, value in saved.items():  # the 2x2 run's parameters, resharded onto 2 ranks
            assert_rel_close(loaded[key], value, 0.0, f"resumed rank {rank}: {key}")
        _assert_curves(curve, t_curve, f"resumed rank {rank}")
        for key, value in t_full.items():
            assert_rel_close(full[key], value, RTOL, f"resumed rank {rank}: {key}")


def test_fsdp1_wrapper_over_torch_tp_trains_like_torch_fsdp2():
    ours = run_on_ranks(4, _curve_program, "wrapper")
    theirs = run_on_ranks(4, _curve_program, "torch")
    for rank in range(4):
        _assert_curves(ours[rank], theirs[rank], f"wrapper rank {rank}")


def _meta_program(ctx, impl):
    """Build on ``meta``, parallelize, ``fully_shard``, ``to_empty``, ``reset_parameters``."""
    mesh = _mesh("torch", 2, 2)
    with torch.device("meta"):
        model = Net()
    _parallelize(model, mesh["tp"])
    fully_shard = _fully_shard(impl)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    init = _full(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return init, _steps(model, opt, mesh["dp"].get_local_rank(), 2, 3, 0, parallel=True)


def test_meta_device_init_over_torch_tp_matches_torch():
    (init, curve), (t_init, t_curve) = (run_on_ranks(4, _meta_program, impl)[0]
                                        for impl in ("ours", "torch"))
    for key, value in t_init.items():  # same local shapes, same RNG: the same values
        assert_rel_close(init[key], value, 0.0, f"init {key}")
    _assert_curves(curve, t_curve, "meta init")
