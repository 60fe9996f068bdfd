"""The demo GPT (tiny) under every strategy, its training steps, and its full state gathered
independently of shardwise.checkpoint (for comparison with a single process)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardwise import DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard
from shardwise.checkpoint import get_state_dict, load, save, set_state_dict
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import lm_loss
from shardwise.sharded_tensor import ChunkShardingSpec, shard_module, sharded_parameters
from shardwise.zero import ZeroDataParallel
from tests.harness import rank_slice, reference_train, token_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=16)
BATCH = 8
LR = 1e-2
STRATEGIES = ("plain", "ddp", "zero1", "zero2", "fsdp", "hsdp", "tp")
DATA_PARALLEL = {"ddp", "zero1", "zero2", "fsdp", "hsdp"}


def tp_plan(group) -> dict:
    # placements name global ranks ([Note: global ranks in placements])
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    col, row = ChunkShardingSpec(0, ranks), ChunkShardingSpec(1, ranks)
    return {"tok_emb": col, "pos_emb": row, "blocks.*.attn.qkv": col, "blocks.*.attn.proj": row,
            "blocks.*.mlp.fc1": col, "blocks.*.mlp.fc2": row, "head": col}


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def build(strategy: str, group, seed: int, cfg: GPTConfig = CFG):
    """(model to call, optimizer, the plain module inside)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    zero_kw = {"optimizer_class": torch.optim.AdamW, "lr": LR, "weight_decay": 0.1}
    if strategy == "plain":
        return model, adamw(model.parameters()), model
    if strategy == "ddp":
        return DistributedDataParallel(model, process_group=group), adamw(model.parameters()), model
    if strategy == "zero1":
        opt = ZeroRedundancyOptimizer(model.parameters(), process_group=group, **zero_kw)
        return DistributedDataParallel(model, process_group=group), opt, model
    if strategy == "zero2":
        opt = ZeroRedundancyOptimizer(model.parameters(), process_group=group, **zero_kw)
        return ZeroDataParallel(model, opt), opt, model
    if strategy == "fsdp":
        for block in model.blocks:
            fully_shard(block, process_group=group)
        fully_shard(model, process_group=group)
        return model, adamw(model.parameters()), model
    if strategy == "hsdp":  # replicate over mesh dim 0, shard over dim 1
        mesh = init_device_mesh("cpu", (2, dist.get_world_size(group) // 2))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, adamw(model.parameters()), model
    if strategy == "tp":
        shard_module(model, tp_plan(group), gather_output=["head"],
                     process_group=group)
        return model, adamw(model.parameters()), model
    raise ValueError(strategy)


def train(strategy: str, wrapped, opt, steps: range, group) -> list[float]:
    """Global-batch losses of ``steps`` (data-parallel ranks take their slice)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for step in steps:
        x, y = token_batch(step, 1, BATCH, CFG.seq_len, CFG.vocab_size)
        x, y = x[0], y[0]
        if strategy in DATA_PARALLEL:
            x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        loss = lm_loss(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if strategy in DATA_PARALLEL:
            dist.all_reduce(value, group=group)
            value /= world
        losses.append(float(value))
    return losses


def reference_losses(state: dict[str, torch.Tensor], steps: range) -> list[float]:
    """One process: the plain model and AdamW set to ``state`` (full tensors), then trained."""
    def loaded():
        model = GPT(CFG)
        model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
        return model

    def loaded_adamw(model):
        opt = adamw(model.parameters())
        for name, p in model.named_parameters():
            opt.state[p] = {k: state[f"optim.{name}.{k}"].clone() for k in
                            ("step", "exp_avg", "exp_avg_sq")}
        return opt

    def loss(model, step):
        x, y = token_batch(step, 1, BATCH, CFG.seq_len, CFG.vocab_size)
        return lm_loss(model(x[0]), y[0])

    return reference_train(loaded, loss, loaded_adamw, steps, seed=None).losses


def full_state(strategy: str, model, opt, group) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor whole, by name, gathered with plain collectives
    (DTensor.full_tensor, all_gather of tensor-parallel shards, broadcast from ZeRO owners)."""
    out = {}
    tp = {id(st.local_shards()[0].tensor): st for m in model.modules()
          for st in sharded_parameters(m).values()}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = _whole(p.detach(), tp.get(id(p)), group)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            out[f"optim.{name}.{key}"] = _opt_value(strategy, opt, p, key, tp.get(id(p)), group)
    return out


def _opt_value(strategy, opt, p, key, st, group):
    if strategy in ("zero1", "zero2"):
        owner = opt.owner_of(p)
        value = opt.state[p][key].clone() if dist.get_rank(group) == owner else (
            torch.zeros(()) if key == "step" else torch.zeros(p.shape))
        dist.broadcast(value, src=dist.get_global_rank(group, owner), group=group)
        return value
    value = opt.state[p][key]
    return _whole(value, st if value.dim() else None, group)


def _whole(t, st, group) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.full_tensor().clone()
    if st is None:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, st.sharding_spec().dim)


# --- bodies run on every rank ------------------------------------------------------------------

def train_and_save(ctx, strategy: str, path: str, steps: int) -> dict | None:
    wrapped, opt, model = build(strategy, ctx.group, seed=0)
    train(strategy, wrapped, opt, range(steps), ctx.group)
    msd, osd = get_state_dict(wrapped, opt)
    save({"model": msd, "optim": osd, "step": steps}, checkpoint_id=path)
    full = full_state(strategy, model, opt, ctx.group)
    return full if ctx.rank == 0 else None


def load_and_train(ctx, strategy: str, path: str, steps: int, more: int):
    wrapped, opt, model = build(strategy, ctx.group, seed=1)
    msd, osd = get_state_dict(wrapped, opt)
    state = {"model": msd, "optim": osd, "step": -1}
    load(state, checkpoint_id=path)
    set_state_dict(wrapped, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    full = full_state(strategy, model, opt, ctx.group)
    losses = train(strategy, wrapped, opt, range(state["step"], state["step"] + more), ctx.group)
    return (full if ctx.rank == 0 else None), losses, state["step"]
