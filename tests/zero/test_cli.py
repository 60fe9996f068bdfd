"""`shardwise train --strategy zero1|zero2`: learning, and exact resume at another world size."""

import dataclasses

import pytest
import torch

from shardwise.cli.train_args import TrainConfig
from tests.harness import run_on_ranks

TINY = TrainConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8, lr=3e-3, warmup=5,
                   eval_batches=4, log_every=5, corpus_bytes=400_000, progress=False)


def _train(ctx, cfg):
    from shardwise.cli.train_loop import train

    result = train(cfg, ctx.group, torch.device("cpu"))
    return result.losses, result.val_start, result.val_end


@pytest.mark.parametrize(("strategy", "first", "second"), [("zero1", 2, 4), ("zero2", 4, 2)])
def test_resume_at_another_world_size_reproduces_the_loss_curve(tmp_path, strategy, first,
                                                                 second):
    straight = dataclasses.replace(TINY, strategy=strategy, steps=10)
    half = dataclasses.replace(straight, steps=5, checkpoint_dir=str(tmp_path / "ck"))
    resumed = dataclasses.replace(half, steps=10, resume=True)
    expected, val_start, val_end = run_on_ranks(second, _train, straight)[0]
    assert val_end < val_start  # it learns
    run_on_ranks(first, _train, half)
    got = run_on_ranks(second, _train, resumed)[0][0]
    assert sorted(got) == list(range(5, 10))
    for step in range(5, 10):
        assert got[step] == pytest.approx(expected[step], rel=1e-5)
