"""FSDP's runtime as a state machine (unit.py, TrainingState): activation checkpointing of
whole units (reentrant and not) and inside a unit, against one process training the plain
model; the states a unit goes through in one iteration; a child run before its root."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from shardwise import fully_shard
from shardwise.fsdp import full_state_dict, units_of
from shardwise.fsdp.unit import TrainingState
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.harness import WORLD_SIZES, assert_rel_close, rank_slice, run_on_ranks, token_batch

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)
BATCH, STEPS, RTOL = 8, 4, 1e-5


class CheckpointedGPT(GPT):
    """Each block (a whole FSDP unit) run under torch.utils.checkpoint: its forward hooks run
    again during backward, when the block is recomputed."""

    reentrant = False

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


def _model(reentrant: bool, reshard: bool):
    torch.manual_seed(0)
    model = CheckpointedGPT(CFG)
    model.reentrant = reentrant
    return model


def _train(ctx, reentrant: bool, reshard: bool):
    reference = _model(reentrant, reshard)
    model = _model(reentrant, reshard)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        x, y = token_batch(step, 1, BATCH, CFG.seq_len, CFG.vocab_size)
        x, y = x[0], y[0]
        loss = lm_loss(model(rank_slice(x, ctx.rank, ctx.world_size)),
                       rank_slice(y, ctx.rank, ctx.world_size))
        loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        ref_loss = sum(lm_loss(reference(rank_slice(x, r, ctx.world_size)),
                               rank_slice(y, r, ctx.world_size)) for r in range(ctx.world_size))
        (ref_loss / ctx.world_size).backward()
        assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item()), step
        assert all(u.state is TrainingState.IDLE for u in units_of(model))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    state = full_state_dict(model)
    for key, value in reference.state_dict().items():
        assert_rel_close(state[key], value, 1e-4, key)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
def test_checkpointed_units_train_like_the_plain_model(world_size, reentrant, reshard):
    run_on_ranks(world_size, _train, reentrant, reshard)


class InAndOut(torch.nn.Module):
    """``inner`` used both inside a reentrant checkpoint and outside it: its parameters'
    gradients arrive twice in one backward (the checkpoint's inner backward delivers its own),
    and possibly after every other parameter of the unit has delivered one."""

    def __init__(self, width: int, reentrant: bool, inner_first: bool):
        super().__init__()
        self.inner = torch.nn.Linear(width, width)
        self.outer = torch.nn.Linear(width, width)
        self.reentrant, self.inner_first = reentrant, inner_first

    def forward(self, x):
        checked = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        if self.inner_first:
            return torch.tanh(self.outer(self.inner(x)) + checked)
        return torch.tanh(self.outer(x) + self.inner(checked))


def _twice_model(reentrant: bool, inner_first: bool, width: int = 8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, width), InAndOut(width, reentrant, inner_first),
                               InAndOut(width, reentrant, not inner_first),
                               torch.nn.Linear(width, 3))


def _train_twice(ctx, reentrant: bool, reshard_after_backward: bool, width: int = 8):
    """SGD (sensitive to a lost or doubled contribution, unlike Adam) on the units above against
    the plain model; gradient shards compared through the parameters after each step."""
    reference = _twice_model(reentrant, True, width)
    model = _twice_model(reentrant, True, width)
    for unit in (model[1], model[2]):
        fully_shard(unit)
    fully_shard(model).set_reshard_after_backward(reshard_after_backward)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        mine = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        torch.nn.functional.mse_loss(model(mine[0]), mine[1]).backward()
        ref_loss = sum(torch.nn.functional.mse_loss(
            reference(rank_slice(x, r, ctx.world_size)), rank_slice(y, r, ctx.world_size))
            for r in range(ctx.world_size)) / ctx.world_size
        ref_loss.backward()
        assert all(u.state is TrainingState.IDLE for u in units_of(model))
        for unit in (model[1], model[2], model):  # kept gathered: stale after the step
            unit.reshard()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    state = full_state_dict(model)
    for key, value in reference.state_dict().items():
        assert_rel_close(state[key], value, 1e-5, key)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reentrant,reshard_after_backward", [
    (False, True), (False, False), (True, False), (True, True)])
def test_gradient_arriving_twice_in_a_unit_is_summed(world_size, reentrant,
                                                     reshard_after_backward):
    """Non-reentrant: one graph, each parameter's gradient arrives once. Reentrant: the
    checkpointed layer's gradient arrives a second time from the inner backward, which
    recomputes the layer after every parameter of the unit already has a gradient from outside
    the checkpoint; the unit's backward ends only when its inputs' gradients are computed, so the
    parameters are still gathered for the recompute and the two contributions are reduced
    together; the result equals the plain model's, with or without resharding after backward."""
    run_on_ranks(world_size, _train_twice, reentrant, reshard_after_backward)


def test_reentrant_checkpoint_inside_a_unit_keeps_large_parameters_rows_for_its_recompute():
    """As above with 512 x 512 layers (sent directly at world size 2, their rows released once
    their gradients are in where that is safe): the layer used outside the checkpoint gets its
    gradient before the checkpoint recomputes with it, so its rows must not have been released
    ([Note: releasing a dead parameter's rows]); the result equals the plain model's."""
    run_on_ranks(2, _train_twice, True, True, 512)
