"""`shardwise train --strategy pipeline`: the training losses and the validation losses equal the
unsplit model's, step by step (1e-5 relative), for each schedule, each transport, 2 and 4
stages, and with two data-parallel replicas of the pipeline (``--dp 2`` on 4 ranks); the
pipeline flags are checked before any rank starts."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.cli.main import main
from shardwise.cli.train_args import TrainConfig
from shardwise.cli.train_loop import train
from tests.harness import run_on_ranks

CFG = TrainConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8, lr=3e-3, warmup=2,
                  steps=5, eval_batches=1, log_every=1, corpus_bytes=64 * 1024, progress=False)


def _train(ctx, cfg):
    result = train(cfg, ctx.group, torch.device("cpu"))
    if cfg.strategy == "pipeline" and cfg.transport == "rpc":
        rpc.shutdown()
    return result.losses, result.val_start, result.val_end


@functools.cache
def reference():
    return run_on_ranks(1, _train, dataclasses.replace(CFG, strategy="ddp"))[0]


CASES = [  # (nproc, dp, schedule, transport, microbatches)
    (2, 1, "gpipe", "p2p", 4), (2, 1, "1f1b", "p2p", 4),
    (2, 1, "gpipe", "rpc", 4), (2, 1, "1f1b", "rpc", 2),
    (4, 1, "gpipe", "p2p", 4), (4, 1, "1f1b", "p2p", 8), (4, 1, "1f1b", "rpc", 4),
    (4, 2, "1f1b", "p2p", 2), (4, 2, "gpipe", "p2p", 4), (4, 2, "1f1b", "rpc", 2),
    (1, 1, "1f1b", "p2p", 2),
]


@pytest.mark.parametrize("nproc,dp,schedule,transport,micro", CASES)
def test_pipeline_losses_equal_unsplit_model(nproc, dp, schedule, transport, micro):
    cfg = dataclasses.replace(CFG, strategy="pipeline", dp=dp, schedule=schedule,
                              transport=transport, microbatches=micro)
    ref_losses, ref_val_start, ref_val_end = reference()
    assert len(ref_losses) == 5
    for losses, val_start, val_end in run_on_ranks(nproc, _train, cfg):
        for step, ref in ref_losses.items():
            assert abs(losses[step] - ref) <= 1e-5 * abs(ref), (step, losses, ref)
        assert val_start == pytest.approx(ref_val_start, rel=1e-5)
        assert val_end == pytest.approx(ref_val_end, rel=1e-5)


def _cli_error(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--dp", "2"], "--dp only apply to --strategy pipeline"),
    (["--schedule", "gpipe", "--microbatches", "4"],
     "--schedule, --microbatches only apply to --strategy pipeline"),
    (["--strategy", "pipeline", "--nproc", "4", "--dp", "3"], "--dp 3 does not divide"),
    (["--strategy", "pipeline", "--nproc", "4", "--n-layer", "1"],
     "a pipeline of 4 stages needs at least 2 layers"),
    (["--strategy", "pipeline", "--nproc", "4", "--dp", "2", "--batch-size", "8",
      "--microbatches", "3"], "4 samples per replica (--dp 2), not divisible by --microbatches"),
    (["--strategy", "pipeline", "--microbatches", "0"], "--microbatches must be at least 1"),
])
def test_pipeline_flags_are_checked_before_start(capsys, argv, message):
    assert message in _cli_error(capsys, *argv)


def test_pipeline_example_matches_unsplit_model():
    import os
    import re

    from tests.harness import procs
    from tests.rpc.conftest import ROOT

    # the example's parent started by tests/harness/procs.py (forked from its server);
    # the stages it spawns are fresh interpreters
    out = procs.run(["examples/pipeline_gpt.py", "--steps", "5"],
                     dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    pairs = re.findall(r"pipeline loss ([\d.]+)\s+unsplit ([\d.]+)", out.stdout)
    assert len(pairs) == 5, out.stdout
    for ours, ref in pairs:
        assert abs(float(ours) - float(ref)) <= 1e-5 * float(ref)
