"""`shardwise train --strategy hsdp --replicas R` and `--strategy fsdp --tp T`: the same losses
as the strategies they must equal, and clear errors for layouts that cannot work.

HSDP 2x2 trains each rank on its quarter of the batch, as FSDP x4 does, with the same gradient
average: the losses agree. FSDP x TP 2x2 trains each tp pair on half the batch, as FSDP x2 does,
and TP computes the same model: the losses agree (TP's row-wise layers add partial products in
another order, hence a relative tolerance, not equality).
"""

import dataclasses

import pytest
import torch

from shardwise.cli.main import main
from shardwise.cli.train_args import TrainConfig
from tests.harness import run_on_ranks

TINY = TrainConfig(strategy="fsdp", n_layer=2, n_head=2, d_model=32, seq_len=32, batch_size=8,
                   lr=3e-3, warmup=2, eval_batches=2, log_every=5, corpus_bytes=200_000,
                   steps=5, progress=False)
RTOL = 1e-5


def _train(ctx, cfg):
    from shardwise.cli.train_loop import train

    result = train(cfg, ctx.group, torch.device("cpu"))
    return result.losses, result.val_end


def _losses(world_size, **options):
    return run_on_ranks(world_size, _train, dataclasses.replace(TINY, **options))[0]


def _assert_same(got, expected):
    (losses, val), (ref_losses, ref_val) = got, expected
    assert sorted(losses) == sorted(ref_losses) == list(range(TINY.steps))
    for step, ref in ref_losses.items():
        assert losses[step] == pytest.approx(ref, rel=RTOL), (step, losses, ref_losses)
    assert val == pytest.approx(ref_val, rel=RTOL)


def test_hsdp_2x2_trains_like_fsdp_on_4():
    _assert_same(_losses(4, strategy="hsdp", replicas=2), _losses(4))


def test_fsdp_with_tp_2_on_4_trains_like_fsdp_on_2():
    _assert_same(_losses(4, tp=2), _losses(2))


def _cli_error(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--strategy", "fsdp", "--tp", "4", "--nproc", "4", "--n-head", "2"],
     "--tp 4 does not divide --n-head 2: every tensor-parallel rank must hold whole attention"),
    (["--strategy", "fsdp", "--tp", "3", "--nproc", "4"], "--tp 3 does not divide the world "
     "size 4"),
    (["--strategy", "hsdp", "--replicas", "3", "--nproc", "4"],
     "--strategy hsdp: 3 replicas do not divide the world size 4"),
    (["--strategy", "ddp", "--replicas", "2"], "--replicas is for --strategy hsdp, not ddp"),
    (["--strategy", "tp", "--tp", "2"], "--tp is for --strategy fsdp (FSDP x TP), not tp"),
    (["--strategy", "fsdp", "--tp", "0"], "--tp must be at least 1, got 0"),
])
def test_bad_mesh_flags_are_named(capsys, argv, message):
    assert message in _cli_error(capsys, *argv)


def test_fsdp_with_tp_resumes_the_uninterrupted_loss_curve(tmp_path):
    straight = dict(tp=2, steps=6)
    expected = _losses(4, **straight)[0]
    first = dict(straight, steps=3, checkpoint_dir=str(tmp_path / "ck"))
    _losses(4, **first)
    got = _losses(4, **dict(first, steps=6, resume=True))[0]
    assert sorted(got) == [3, 4, 5]
    for step in (3, 4, 5):
        assert got[step] == pytest.approx(expected[step], rel=1e-6)
