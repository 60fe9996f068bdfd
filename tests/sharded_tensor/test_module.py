"""Sharding modules in place: the demo GPT trained tensor-parallel against the unsharded model,
state_dict round trips, and `shardwise train --strategy tp`."""

import dataclasses
import functools
import io

import pytest
import torch

from shardwise.cli.strategy_tp import gpt_plan
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.sharded_tensor import (
    ChunkShardingSpec,
    ShardedTensor,
    ShardingError,
    shard_module,
    shard_parameter,
    sharded_parameters,
)
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

# vocab 67 is uneven over 2 and 4 ranks (token embedding and LM head); 4 heads split evenly
CFG = GPTConfig(vocab_size=67, seq_len=8, n_layer=2, n_head=4, d_model=16)
LOSS_RTOL = 1e-5


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _sharded_gpt(ws, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    plan, gathered = gpt_plan(ws)
    return shard_module(model, plan, gather_output=gathered)


def _assert_params_match(model, reference, rtol, what):
    dense = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        st = sharded_parameters(model.get_submodule(module_name)).get(attr)
        box = ... if st is None else st.local_shards()[0].metadata.region()
        expected = dense[name][box]
        assert_rel_close(p, expected, rtol, f"{what}: {name}")


def _train(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=1)
def _dense_reference(steps):
    """The unsharded model trained in this (test) process: losses and final parameters."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = GPT(CFG)
    losses = _train(reference, steps)
    return losses, {k: v.detach().clone() for k, v in reference.named_parameters()}


def _train_body(ctx, steps, ref_params):
    model = _sharded_gpt(ctx.world_size)
    # embeddings; qkv, proj, fc1 (+ its bias), fc2 per block; the head
    sharded = sum(len(sharded_parameters(m)) for m in model.modules())
    assert sharded == 2 + 5 * CFG.n_layer + 1, sharded
    assert isinstance(model.blocks[0].mlp.fc1.weight, ShardedTensor)  # forward sees the sharding
    losses = _train(model, steps)
    reference = GPT(CFG)
    reference.load_state_dict(ref_params, strict=False)
    _assert_params_match(model, reference, 1e-4, "after training")
    return losses


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gpt_sharded_by_plan_trains_10_adamw_steps_like_the_unsharded_model(world_size):
    ref_losses, ref_params = _dense_reference(10)
    per_rank = run_on_ranks(world_size, _train_body, 10, ref_params)
    for losses in per_rank:
        assert losses == per_rank[0]  # every rank computes the same loss
    for step, (loss, ref) in enumerate(zip(per_rank[0], ref_losses)):
        assert abs(loss - ref) <= LOSS_RTOL * abs(ref), (step, per_rank[0], ref_losses)


def _state_dict_body(ctx):
    ws = ctx.world_size
    model = _sharded_gpt(ws, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(2):
        lm_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    assert isinstance(state["blocks.0.mlp.fc1.weight"], ShardedTensor)
    assert state["blocks.0.mlp.fc1.weight"].size() == torch.Size([4 * CFG.d_model, CFG.d_model])
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = _sharded_gpt(ws, seed=1)  # different values everywhere
    fresh.load_state_dict(loaded)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    x = _batch(5)[0]
    assert torch.equal(model(x), fresh(x))
    # a whole (unsharded) state dict loads too: each rank keeps its boxes
    torch.manual_seed(3)
    dense = GPT(CFG)
    fresh.load_state_dict(dense.state_dict())
    _assert_params_match(fresh, dense, 0.0, "dense load")
    assert_rel_close(fresh(x), dense(x), 1e-6, "output after a dense load")
    # a checkpoint sharded another way is refused, naming both specs
    fc1 = torch.nn.Linear(CFG.d_model, 4 * CFG.d_model)
    shard_parameter(fc1, "weight", ChunkShardingSpec(1, list(range(ws))))
    saved = {"weight": state["blocks.0.mlp.fc1.weight"]}
    try:
        fc1.load_state_dict(saved, strict=False)
    except ShardingError as err:
        return str(err)
    return None


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_round_trips_exactly(world_size):
    message = run_on_ranks(world_size, _state_dict_body)[0]
    if world_size == 1:  # one rank: both specs give the one whole box, so it loads
        assert message is None
        return
    assert "weight was saved as ChunkShardingSpec(dim=0" in message
    assert "the module is sharded as ChunkShardingSpec(dim=1" in message


def _plan_errors_body(ctx):
    model = GPT(CFG)
    out = []
    for call in (lambda: shard_module(model, {"blocks.*.mlp.fc9": ChunkShardingSpec(0, [0])}),
                 lambda: shard_parameter(model.ln_f, "scale", ChunkShardingSpec(0, [0])),
                 lambda: shard_parameter(model.ln_f, "weight", ChunkShardingSpec(0, [1]))):
        try:
            call()
        except ShardingError as err:
            out.append(str(err))
    return out


def test_plan_errors_are_clear():
    nomatch, noparam, ranks = run_on_ranks(1, _plan_errors_body)[0]
    assert "'blocks.*.mlp.fc9' matches no module of GPT" in nomatch
    assert "LayerNorm has no parameter 'scale'" in noparam and "'weight'" in noparam
    assert "Global rank 1 does not exist in input process group" in ranks
    assert "global ranks are [0]" in ranks



def _cli_train(ctx, cfg):
    from shardwise.cli.train_loop import train

    return train(cfg, ctx.group, torch.device("cpu")).losses


def test_shardwise_train_strategy_tp_matches_one_process(tmp_path):
    from shardwise.cli.train_args import TrainConfig

    tiny = TrainConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8, lr=3e-3,
                       warmup=2, eval_batches=2, log_every=3, corpus_bytes=200_000,
                       progress=False, steps=6)
    one = run_on_ranks(1, _cli_train, dataclasses.replace(tiny, strategy="ddp"))[0]
    tp = run_on_ranks(2, _cli_train, dataclasses.replace(tiny, strategy="tp"))[0]
    assert sorted(tp) == list(range(6))
    for step in range(6):
        assert abs(tp[step] - one[step]) <= LOSS_RTOL * abs(one[step]), (step, tp, one)
    ck = dataclasses.replace(tiny, strategy="tp", checkpoint_dir=str(tmp_path / "ck"))
    run_on_ranks(2, _cli_train, dataclasses.replace(ck, steps=3))
    resumed = run_on_ranks(2, _cli_train, dataclasses.replace(ck, resume=True))[0]
    assert sorted(resumed) == [3, 4, 5]
    for step in range(3, 6):
        assert resumed[step] == tp[step], (step, resumed, tp)
