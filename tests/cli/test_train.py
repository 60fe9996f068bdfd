"""`shardwise train`: learning, exact resume, and clear errors for bad input."""

import dataclasses
import os

import pytest
import torch

from shardwise.cli.main import main
from shardwise.cli.train_args import TrainConfig
from tests.harness import run_on_ranks

TINY = TrainConfig(n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8, lr=3e-3, warmup=5,
                   eval_batches=4, log_every=5, corpus_bytes=400_000, progress=False)


def _train(ctx, cfg):
    from shardwise.cli.train_loop import train

    result = train(cfg, ctx.group, torch.device("cpu"))
    return result.losses, result.val_start, result.val_end


def test_validation_loss_falls(tmp_path):
    cfg = dataclasses.replace(TINY, steps=40)
    losses, val_start, val_end = run_on_ranks(2, _train, cfg)[0]
    assert val_end < val_start - 1.0, (val_start, val_end)
    assert losses[39] < losses[0]


@pytest.mark.parametrize("world_size", (1, 2))
def test_resume_reproduces_the_uninterrupted_loss_curve(tmp_path, world_size):
    straight = dataclasses.replace(TINY, steps=12)
    first = dataclasses.replace(straight, steps=6, checkpoint_dir=str(tmp_path / "ck"))
    resumed = dataclasses.replace(first, steps=12, resume=True)
    expected = run_on_ranks(world_size, _train, straight)[0][0]
    run_on_ranks(world_size, _train, first)
    got = run_on_ranks(world_size, _train, resumed)[0][0]
    assert sorted(got) == list(range(6, 12))
    for step in range(6, 12):
        assert got[step] == pytest.approx(expected[step], rel=1e-5)


def test_checkpoint_is_atomic_and_latest_points_at_complete_step(tmp_path):
    cfg = dataclasses.replace(TINY, steps=4, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    run_on_ranks(2, _train, cfg)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_000002", "step_000004"]
    assert (tmp_path / "latest").read_text() == "step_000004"
    assert not list(tmp_path.rglob("*.tmp*"))


def _cli_error(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def test_nproc_zero_is_rejected(capsys):
    assert "--nproc must be at least 1, got 0" in _cli_error(capsys, "--nproc", "0")


def test_world_larger_than_batch_is_rejected(capsys):
    err = _cli_error(capsys, "--nproc", "4", "--batch-size", "2")
    assert "--batch-size 2 is smaller than the world size 4" in err


def test_unknown_strategy_lists_the_valid_ones(capsys):
    err = _cli_error(capsys, "--strategy", "zero9")
    assert "unknown strategy 'zero9'" in err and "ddp" in err


def test_unwritable_checkpoint_dir_is_rejected(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    err = _cli_error(capsys, "--checkpoint-dir", str(blocker / "ck"))
    assert "is not writable" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_read_only_checkpoint_dir_is_rejected(capsys, tmp_path):
    tmp_path.chmod(0o500)
    try:
        assert "is not writable" in _cli_error(capsys, "--checkpoint-dir", str(tmp_path / "ck"))
    finally:
        tmp_path.chmod(0o700)


def test_resume_from_a_different_model_names_the_differences(capsys, tmp_path):
    cfg = dataclasses.replace(TINY, steps=2, checkpoint_dir=str(tmp_path))
    run_on_ranks(1, _train, cfg)
    err = _cli_error(capsys, "--checkpoint-dir", str(tmp_path), "--resume", "--n-layer", "3",
                     "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--steps", "4")
    assert "is of a different model" in err and "n_layer=2 (this run: 3)" in err


def test_resume_without_checkpoint_is_rejected(capsys, tmp_path):
    err = _cli_error(capsys, "--checkpoint-dir", str(tmp_path), "--resume")
    assert "no checkpoint to resume from" in err


def test_cli_end_to_end_with_two_ranks(tmp_path, capfd):
    code = main(["train", "--nproc", "2", "--n-layer", "1", "--d-model", "32", "--n-head", "2",
                 "--seq-len", "32", "--steps", "3", "--batch-size", "4", "--eval-batches", "1",
                 "--corpus-bytes", "200000", "--no-progress"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "[rank0]: validation loss at end:" in out
    assert "[rank1]:" not in out  # only rank 0 reports
