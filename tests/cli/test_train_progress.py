"""The progress bar shows the latest step's loss (the mean over ranks, all-reduced every step),
not the loss of the last ``--log-every`` step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.cli.train_args import TrainConfig
from tests.harness import run_on_ranks

CFG = dataclasses.replace(TrainConfig(), n_layer=1, n_head=2, d_model=16, seq_len=16, steps=5,
                          batch_size=4, log_every=3, eval_batches=1, corpus_bytes=200_000)


class _Bar:
    """tqdm's part the loop uses, recording the text shown after each step."""

    shown: list[str] = []

    def __init__(self, *args, **kwargs):
        self.text = ""

    def set_postfix_str(self, text, refresh=True):
        self.text = text

    def update(self, n=1):
        self.shown.append(self.text)

    def close(self):
        pass


def _train_recording_the_bar(ctx, cfg):
    from shardwise.cli import train_loop

    _Bar.shown = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_loop, "tqdm", _Bar)
        result = train_loop.train(cfg, ctx.group, torch.device("cpu"))
    return result.losses, list(_Bar.shown)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_bar_shows_each_steps_loss(world_size):
    losses, shown = run_on_ranks(world_size, _train_recording_the_bar, CFG)[0]
    assert len(shown) == CFG.steps
    for step, text in enumerate(shown):
        assert text.startswith(f"loss={losses[step]:.4f}"), (step, text, losses)
        assert ("tok/s=" in text) == (step + 1 >= CFG.log_every), (step, text)
