"""`--strategy pipeline`: the loss equals the unsplit model's, step by step (1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.cli.train_args import TrainConfig
from shardwise.cli.train_loop import train
from tests.harness import run_on_ranks

CFG = TrainConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8, lr=3e-3, warmup=2,
                  steps=5, eval_batches=1, log_every=1, corpus_bytes=64 * 1024, progress=False)


def _train(ctx, strategy):
    from dataclasses import replace

    result = train(replace(CFG, strategy=strategy), ctx.group, torch.device("cpu"))
    if strategy == "pipeline":
        rpc.shutdown()
    return result.losses


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pipeline_loss_equals_unsplit_model(world_size):
    reference = run_on_ranks(1, _train, "ddp")[0]  # one rank: the plain, unsplit model
    losses = run_on_ranks(world_size, _train, "pipeline")
    assert len(reference) == 5
    for rank_losses in losses:
        for step, ref in reference.items():
            assert abs(rank_losses[step] - ref) <= 1e-5 * abs(ref), (step, rank_losses, ref)


def test_pipeline_example_matches_unsplit_model():
    import re
    import subprocess
    import sys

    from tests.rpc.conftest import ROOT

    out = subprocess.run([sys.executable, "examples/pipeline_gpt.py", "--steps", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pairs = re.findall(r"pipeline loss ([\d.]+)\s+unsplit ([\d.]+)", out.stdout)
    assert len(pairs) == 5, out.stdout
    for ours, ref in pairs:
        assert abs(float(ours) - float(ref)) <= 1e-5 * float(ref)
