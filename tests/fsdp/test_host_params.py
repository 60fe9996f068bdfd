"""FSDP's parameters held once per host ([Note: parameters shared on one host],
shardwise/fsdp/host_params.py): used where the ranks share a host, the same numbers as the
gathers give, and no rank ever computes with rows a peer writes before or after the pass."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from shardwise import fully_shard
from shardwise.fsdp import MixedPrecisionPolicy, units_of, unsharded_bytes
from shardwise.memory import state_bytes
from tests.fsdp.gathering import gathering_units
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

WIDTH = 24
SLOW_S = 0.3  # how far the slow rank lags: long enough for a fast rank to write meanwhile


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    return model


def _handles(model):
    return [u.handle for u in units_of(model) if u.handle is not None]


def _who_shares(ctx):
    shared = [h.host is not None for h in _handles(_shard(_model()))]
    with gathering_units():
        off = [h.host is not None for h in _handles(_shard(_model()))]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mixed = [h.host is not None for h in _handles(_shard(_model(), mp_policy=policy))]
    model = _shard(_model())
    model.double()  # converted: private buffers, gathered again
    converted = [h.host is not None for h in _handles(model)]
    with torch.device("meta"):
        meta = _shard(_model())
    before = [h.host is not None for h in _handles(meta)]
    meta.to_empty(device="cpu")  # every rank materializes: shared from here on
    materialized = [h.host is not None for h in _handles(meta)]
    return shared, off, mixed, converted, before, materialized


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_units_share_their_parameters_only_where_the_note_allows(world_size):
    for shared, off, mixed, converted, before, materialized in run_on_ranks(world_size,
                                                                            _who_shares):
        assert shared == [world_size > 1] * 2  # one rank: nothing to share
        assert not any(off) and not any(mixed) and not any(converted) and not any(before)
        assert materialized == shared


def _lagging_peer(ctx):
    """Rank 1 lags inside forward (before the second layer) and before writing its rows; every
    rank writes its own rows at once after each forward. Returns each pass's output and the
    parameters after the last write, whole."""
    model = _shard(_model())
    reference = _model()
    assert all(h.host is not None for h in _handles(model)) or ctx.world_size == 1
    if ctx.rank == 1:
        model[2].register_forward_pre_hook(lambda *_: time.sleep(SLOW_S))
    x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    outs, expected = [], []
    for _ in range(3):
        with torch.no_grad():
            outs.append(model(x))
            expected.append(reference(x))
        if ctx.rank == 1:
            time.sleep(SLOW_S)  # writes late: a fast peer's next forward must wait for them
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(0.5)  # this rank's rows only
            for p in reference.parameters():
                p.mul_(0.5)
    return outs, expected


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_lagging_peer_never_computes_with_rows_written_outside_the_pass(world_size):
    for outs, expected in run_on_ranks(world_size, _lagging_peer):
        for got, want in zip(outs, expected):
            assert_rel_close(got, want, 1e-6, "forward output")


def _train(ctx, gather: bool):
    torch.manual_seed(0)
    model, reference = _model(), _model()
    if gather:
        with gathering_units():
            _shard(model)
    else:
        _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    xs = [torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(r))
          for r in range(ctx.world_size)]
    losses = []
    for _ in range(3):
        loss = model(xs[ctx.rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = sum(reference(x).square().mean() for x in xs) / ctx.world_size
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():  # an evaluation between steps reads the updated rows
            model(xs[ctx.rank])
    whole = [p.full_tensor() for p in model.parameters()]
    held, full = state_bytes(model, opt), state_bytes(reference, ref_opt)
    return losses, whole, [p.detach() for p in reference.parameters()], held, full, \
        unsharded_bytes(model)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_matches_the_single_process_reference_and_the_gathers(world_size):
    shared = run_on_ranks(world_size, _train, False)
    gathered = run_on_ranks(world_size, _train, True)
    for (losses, whole, ref, held, full, unsharded), (g_losses, g_whole, *_) in zip(shared,
                                                                                     gathered):
        for got, want in zip(whole, ref):
            assert_rel_close(got, want, 1e-5, "parameter after 3 steps")
        assert losses == g_losses  # bit for bit: the same arithmetic, only no gathers
        for got, want in zip(whole, g_whole):
            assert torch.equal(got, want)
        # a rank's rows count, not the mapping around them; nothing is allocated to unshard
        pad = 2 * WIDTH * 4  # rows round up per parameter
        assert held.params <= full.params / world_size + pad, (held, full)
        assert unsharded == 0
