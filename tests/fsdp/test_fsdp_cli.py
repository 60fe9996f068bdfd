"""`shardwise train --strategy fsdp`: learning, bf16, CPU offload, exact per-rank resume."""

import dataclasses

import pytest
import torch

from shardwise.cli.train_args import TrainConfig
from tests.harness import run_on_ranks

TINY = TrainConfig(strategy="fsdp", n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8,
                   lr=3e-3, warmup=5, eval_batches=4, log_every=5, corpus_bytes=400_000,
                   progress=False)


def _train(ctx, cfg):
    from shardwise.cli.train_loop import train

    result = train(cfg, ctx.group, torch.device("cpu"))
    return result.losses, result.val_start, result.val_end


@pytest.mark.parametrize("options", [{}, {"mixed_precision": "bf16", "cpu_offload": True}])
def test_fsdp_strategy_learns(options):
    cfg = dataclasses.replace(TINY, steps=30, **options)
    losses, val_start, val_end = run_on_ranks(2, _train, cfg)[0]
    assert val_end < val_start - 0.5, (val_start, val_end)
    assert losses[29] < losses[0]


def test_fsdp_resume_reproduces_the_uninterrupted_loss_curve(tmp_path):
    straight = dataclasses.replace(TINY, steps=10)
    first = dataclasses.replace(straight, steps=5, checkpoint_dir=str(tmp_path / "ck"))
    resumed = dataclasses.replace(first, steps=10, resume=True)
    expected = run_on_ranks(2, _train, straight)[0][0]
    run_on_ranks(2, _train, first)
    got = run_on_ranks(2, _train, resumed)[0][0]
    assert sorted(got) == list(range(5, 10))
    for step in range(5, 10):
        assert got[step] == pytest.approx(expected[step], rel=1e-5)
