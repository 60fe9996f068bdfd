"""`shardwise train --resume` across strategies and world sizes (issue 13): a run saved under
strategy A at world size w1 continues under strategy B at w2 with the losses of one process
trained without interruption (1e-6); `--async-checkpoint` saves are complete and resumable;
`--keep` keeps the newest complete checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from shardwise.checkpoint import inspect
from shardwise.cli.train_args import ConfigError, TrainConfig, validate
from tests.harness import run_on_ranks

# n_head 4: tensor parallelism at 2 and 4 ranks holds whole heads
TINY = TrainConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, batch_size=8, lr=3e-3, warmup=2,
                   eval_batches=1, log_every=100, corpus_bytes=200_000, progress=False)
SAVED_AT, END = 3, 6
PAIRS = [  # (strategy, world size) that saves -> (strategy, world size) that resumes
    (("fsdp", 4), ("ddp", 2)),
    (("ddp", 2), ("fsdp", 4)),
    (("zero2", 2), ("tp", 2)),
    (("tp", 4), ("zero1", 2)),
    (("zero1", 4), ("zero2", 1)),
    (("fsdp", 2), ("tp", 4)),
]


def _train(ctx, cfg: TrainConfig, fault_hook=None):
    from shardwise.cli.train_loop import train

    validate(cfg, ctx.world_size)  # what `shardwise train` checks before starting the ranks
    return train(cfg, ctx.group, torch.device("cpu"), _fault_hook=fault_hook).losses


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, float]:
    """One process, never stopped: the losses every resumed run must reproduce."""
    return run_on_ranks(1, _train, dataclasses.replace(TINY, steps=END))[0]


def _assert_losses(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got, want)


@pytest.mark.parametrize(("src", "dst"), PAIRS,
                         ids=[f"{a}x{n}-to-{b}x{m}" for (a, n), (b, m) in PAIRS])
def test_resume_under_another_strategy_and_world_size(tmp_path, uninterrupted, src, dst):
    first = dataclasses.replace(TINY, steps=SAVED_AT, strategy=src[0],
                                checkpoint_dir=str(tmp_path))
    _assert_losses(run_on_ranks(src[1], _train, first)[0], uninterrupted, range(SAVED_AT))
    resumed = dataclasses.replace(first, steps=END, strategy=dst[0], resume=True,
                                  override=("strategy",))
    got = run_on_ranks(dst[1], _train, resumed)
    for rank_losses in got:
        _assert_losses(rank_losses, uninterrupted, range(SAVED_AT, END))
    record = json.loads(inspect(tmp_path / "step_000006")["values"]["train"])
    assert (record["strategy"], record["world_size"], record["step"]) == (dst[0], dst[1], END)


def test_another_strategy_needs_override_but_another_world_size_does_not(tmp_path):
    first = dataclasses.replace(TINY, steps=2, strategy="fsdp", checkpoint_dir=str(tmp_path))
    run_on_ranks(2, _train, first)
    with pytest.raises(ConfigError, match=r"strategy=fsdp \(this run: ddp\)"):
        validate(dataclasses.replace(first, steps=4, strategy="ddp", resume=True), 2)
    validate(dataclasses.replace(first, steps=4, resume=True), 4)


def test_async_checkpoints_are_complete_and_resume_exactly(tmp_path, uninterrupted):
    # fsdp x2, a background save after steps 2 and 4, the last one (step 5) in the foreground
    cfg = dataclasses.replace(TINY, steps=5, strategy="fsdp", checkpoint_dir=str(tmp_path),
                              checkpoint_every=2, async_checkpoint=True)
    _assert_losses(run_on_ranks(2, _train, cfg)[0], uninterrupted, range(5))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_000002", "step_000004", "step_000005"], names
    # resume from the background save of step 4 (as after a crash before step 5's save)
    (tmp_path / "latest").write_text("step_000004")
    resumed = dataclasses.replace(cfg, steps=END, strategy="zero2", resume=True,
                                  override=("strategy",), async_checkpoint=False)
    _assert_losses(run_on_ranks(4, _train, resumed)[0], uninterrupted, range(4, END))


def _failing_write(ctx, cfg: TrainConfig):
    """A background save whose write fails on rank 1: the next save raises on every rank."""
    from shardwise.checkpoint import saver

    def fail(point, index):  # rank 1's data file fails mid-write: it never writes its part
        if point == "chunk" and index == 0 and ctx.rank == 1:
            raise OSError(28, "No space left on device")

    try:
        return _train(ctx, cfg, fail)
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return f"{type(exc).__name__}: {exc}"
    finally:
        saver._pending.clear()


def test_a_failed_background_save_stops_training_with_its_error(tmp_path):
    cfg = dataclasses.replace(TINY, steps=5, strategy="fsdp", checkpoint_dir=str(tmp_path),
                              checkpoint_every=2, async_checkpoint=True)
    results = run_on_ranks(2, _failing_write, cfg, timeout=180)
    for text in results:  # rank 0 learns of rank 1's failure from the directory at once
        assert "the background save of" in text and "No space left" in text, results
    assert not (tmp_path / "latest").exists()  # no checkpoint was ever completed


def test_keep_leaves_the_newest_complete_checkpoints(tmp_path):
    cfg = dataclasses.replace(TINY, steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=1,
                              keep=2, async_checkpoint=True)
    run_on_ranks(2, _train, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004",
                                                          "step_000005"]
    assert (tmp_path / "latest").read_text() == "step_000005"


def _disk_fills_on_second_save(ctx, cfg: TrainConfig):
    """Rank 0's data file of the second save fails with ENOSPC after its first chunk."""

    saves = []

    def full(point, index):
        if point == "chunk" and ctx.rank == 0:
            saves.append(index)
            if saves.count(0) == 2:
                raise OSError(28, "No space left on device")

    try:
        return _train(ctx, cfg, full)
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return f"{type(exc).__name__}: {exc}"


def test_a_disk_that_fills_during_a_save_leaves_the_previous_checkpoint_to_resume(
        tmp_path, uninterrupted):
    cfg = dataclasses.replace(TINY, steps=END, strategy="fsdp", checkpoint_dir=str(tmp_path),
                              checkpoint_every=2)
    for text in run_on_ranks(2, _disk_fills_on_second_save, cfg):
        assert "save failed while writing: rank 0: OSError: [Errno 28] No space left" in text
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert not (tmp_path / "step_000004").exists()
    got = run_on_ranks(2, _train, dataclasses.replace(cfg, resume=True))[0]
    _assert_losses(got, uninterrupted, range(2, END))
    assert not (tmp_path / "step_000004.tmp").exists()  # the leftover is removed at start


@pytest.mark.parametrize(("point", "index", "mode"), [
    ("chunk", 1, "sync"),  # inside the data file
    ("metadata", 0, "sync"),  # metadata written, not yet renamed into place
    ("chunk", 1, "async"),  # in the background writer
])
def test_a_run_killed_during_a_save_resumes_from_the_previous_checkpoint(
        tmp_path, uninterrupted, point, index, mode):
    import os
    import sys
    from pathlib import Path

    from tests.harness import procs

    ck = tmp_path / "ck"
    script = Path(__file__).with_name("crash_train.py")
    # `python crash_train.py ...`, started by tests/harness/procs.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = procs.run([str(script), str(ck), str(tmp_path / "store"), point, str(index), mode],
                      env, timeout=300)
    assert proc.returncode == 17, proc.stderr
    assert (ck / "latest").read_text() == "step_000002"
    assert not (ck / "step_000004").exists() and (ck / "step_000004.tmp").exists()
    resumed = dataclasses.replace(TINY, steps=END, checkpoint_dir=str(ck), resume=True)
    _assert_losses(run_on_ranks(2, _train, resumed)[0], uninterrupted, range(2, END))


def _train_any(ctx, cfg: TrainConfig):
    try:
        return _train(ctx, cfg)
    finally:
        if cfg.strategy == "pipeline":
            import shardwise.rpc as rpc

            rpc.shutdown()


@pytest.mark.parametrize(("src", "dst"), [(("pipeline", 2), ("fsdp", 4)),
                                          (("zero2", 4), ("pipeline", 2))],
                         ids=["pipelinex2-to-fsdpx4", "zero2x4-to-pipelinex2"])
def test_pipeline_stages_save_their_layers_and_resume_anywhere(tmp_path, uninterrupted, src,
                                                               dst):
    """Each stage writes its own layers; the param groups name every layer, so a pipeline
    checkpoint loads into any strategy and any into a pipeline. 1e-5: the pipeline's
    micro-batches sum gradients in another order (as in tests/rpc/test_pipeline.py)."""
    first = dataclasses.replace(TINY, steps=SAVED_AT, strategy=src[0],
                                checkpoint_dir=str(tmp_path))
    run_on_ranks(src[1], _train_any, first)
    if src[0] == "pipeline":
        files = {c["file"] for name, t in inspect(tmp_path / "step_000003")["tensors"].items()
                 if name.startswith("model.") for c in t["chunks"]}
        assert files == {"rank_00000.bin", "rank_00001.bin"}
    resumed = dataclasses.replace(first, steps=END, strategy=dst[0], resume=True,
                                  override=("strategy",))
    for rank_losses in run_on_ranks(dst[1], _train_any, resumed):
        assert sorted(rank_losses) == list(range(SAVED_AT, END))
        for step, loss in rank_losses.items():
            assert loss == pytest.approx(uninterrupted[step], rel=1e-5), (step, rank_losses)


@pytest.mark.parametrize("options", [{"mixed_precision": "bf16"}, {"cpu_offload": True}],
                         ids=["bf16", "cpu-offload"])
def test_fsdp_options_resume_exactly(tmp_path, options):
    """FSDP with bf16 compute or CPU offload keeps fp32 shards: they and AdamW's state are what
    is saved, so a resume continues that run's own uninterrupted losses."""
    base = dataclasses.replace(TINY, strategy="fsdp", **options)
    straight = run_on_ranks(2, _train, dataclasses.replace(base, steps=END))[0]
    first = dataclasses.replace(base, steps=SAVED_AT, checkpoint_dir=str(tmp_path))
    run_on_ranks(2, _train, first)
    got = run_on_ranks(2, _train, dataclasses.replace(first, steps=END, resume=True))[0]
    _assert_losses(got, straight, range(SAVED_AT, END))
