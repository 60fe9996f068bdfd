"""`shardwise train --log-dir`: metrics whose losses are the printed ones, the loss-curve PNG,
TensorBoard events its own reader loads; `shardwise plot` of several runs; bad input."""

import json
import os
import re
import struct

import pytest

from shardwise.cli.curves import SIZE_PX, read_metrics
from shardwise.cli.main import main
from tests.harness import procs

MODEL = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
         "--batch-size", "4", "--eval-batches", "1", "--corpus-bytes", "200000"]


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("run") / "ddp-run"
    ckpt = tmp_path_factory.mktemp("ckpt")
    # the launcher started by tests/harness/procs.py (forked from its server); its
    # ranks get OMP_NUM_THREADS=1 as the launcher gave them on two cores (2 // nproc)
    proc = procs.run(
        ["-m", "shardwise", "train", "--nproc", "2", *MODEL, "--steps", "6",
         "--log-every", "2", "--no-progress", "--log-dir", str(log_dir),
         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"],
        dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return log_dir, proc.stdout


def test_metrics_hold_the_printed_losses_and_every_field(logged_run):
    log_dir, out = logged_run
    rows = read_metrics(log_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    printed = {int(s): float(v) for s, v in re.findall(r"step (\d+)/6 loss (\S+)", out)}
    assert sorted(printed) == [2, 4, 6]
    for row in rows:
        if row["step"] in printed:
            assert row["loss"] == printed[row["step"]]  # the same float, not merely close
        assert len(row["peak_mib"]) == 2 and min(row["peak_mib"]) > 0
        assert row["tokens_per_s"] > 0 and row["lr"] > 0
    final = float(re.search(r"train loss at step 6: (\S+)", out).group(1))
    assert round(rows[-1]["loss"], 6) == final
    assert [r["time_s"] for r in rows] == sorted(r["time_s"] for r in rows)
    assert rows[0]["lr"] < rows[-1]["lr"]  # warm-up: the learning rate each step used


def test_loss_curve_png_is_drawn(logged_run):
    log_dir, _ = logged_run
    assert png_size(log_dir / "loss.png") == SIZE_PX


def test_tensorboard_reads_the_event_files(logged_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, _ = logged_run
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tokens_per_s", "memory/peak_mib_rank0",
            "memory/peak_mib_rank1"} <= set(tags)
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    for row in read_metrics(log_dir):
        assert losses[row["step"]] == pytest.approx(row["loss"], rel=1e-6)  # stored as float32


def _fake_run(directory, losses):
    directory.mkdir()
    with (directory / "metrics.jsonl").open("w") as f:
        for step, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 100.0,
                                "peak_mib": [1.0], "time_s": step, "wall_time": step}) + "\n")


def test_plot_draws_several_runs_on_one_chart(logged_run, tmp_path, capsys):
    log_dir, _ = logged_run
    _fake_run(tmp_path / "fsdp-run", [5.6, 5.4, 5.1])
    out = tmp_path / "compare.png"
    assert main(["plot", str(log_dir), str(tmp_path / "fsdp-run"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and png_size(out) == SIZE_PX
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path / "missing"), "--out", str(out)])
    assert exit_info.value.code == 2
    assert "no metrics file metrics.jsonl" in capsys.readouterr().err


def test_a_resumed_run_appends_and_later_rows_win(tmp_path):
    _fake_run(tmp_path / "run", [3.0, 2.0])
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "loss": 1.5, "tokens_per_s": None}) + "\n")
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == [3.0, 1.5]


def test_an_unwritable_log_dir_is_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--nproc", "1", *MODEL, "--log-dir", str(blocker / "logs")])
    assert exit_info.value.code == 2
    assert f"--log-dir {blocker / 'logs'} is not writable" in capsys.readouterr().err
