"""`shardwise train` under faults: SIGTERM mid-run, a rank killed under --max-restarts, and the
checks a resume must pass (every difference named, --override, the latest pointer, damaged
metadata, leftovers, --keep)."""

import dataclasses
import json
import os
import re
import signal
import subprocess

import pytest
import torch

from shardwise.cli.main import main
from shardwise.cli.train_args import ConfigError, validate
from tests.cli.test_train import TINY
from tests.harness import RankFailure, procs, run_on_ranks

CLI_MODEL = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
             "--batch-size", "8", "--lr", "0.003", "--warmup", "5", "--eval-batches", "1",
             "--corpus-bytes", "400000", "--no-progress", "--log-every", "1"]
STEP_LINE = re.compile(r"\[rank0\]: step (\d+)/\d+ loss (\S+)")


def _train(ctx, cfg, preempt_after=None):
    from shardwise.cli.train_loop import train
    from shardwise.launch.preemption import Preempted, Preemption

    preemption = Preemption(grace_seconds=30)
    with pytest.MonkeyPatch.context() as patch:
        if preempt_after is not None and ctx.rank == 0:
            import shardwise.cli.train_loop as loop

            original = loop.beat

            def beat_then_request():  # rank 0 alone is asked to stop, after `preempt_after` steps
                original()
                beat_then_request.calls += 1
                if beat_then_request.calls == preempt_after:
                    preemption.request()

            beat_then_request.calls = 0
            patch.setattr(loop, "beat", beat_then_request)
        try:
            result = train(cfg, ctx.group, torch.device("cpu"), preemption)
            return result.losses, None
        except Preempted as stop:
            return None, (stop.step, stop.saved)


def _cli(*argv):
    # the launcher started by tests/harness/procs.py (forked from its server), read
    # as it runs; its ranks get OMP_NUM_THREADS=1 as the launcher gave them on two cores
    return procs.start(["-m", "shardwise", "train", "--nproc", "2", *CLI_MODEL, *argv],
                        dict(os.environ, OMP_NUM_THREADS="1"), merge_stderr=False, streams=True)


def _losses(lines):
    return {int(m[1]) - 1: float(m[2]) for m in map(STEP_LINE.match, lines) if m}


def _read_until_step(proc, step):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = STEP_LINE.match(line)
        if m and int(m[1]) >= step:
            return lines
    raise AssertionError(f"the job ended before step {step}:\n{proc.stderr.read()}")


def test_sigterm_writes_a_checkpoint_and_resume_reproduces_the_uninterrupted_losses(tmp_path):
    ck = tmp_path / "ck"
    job = _cli("--steps", "400", "--checkpoint-dir", str(ck), "--grace-seconds", "60")
    _read_until_step(job, 3)
    job.send_signal(signal.SIGTERM)
    rest, err = job.communicate(timeout=300)
    assert job.returncode == 143, err
    assert "stopped on SIGTERM after step" in err and "checkpoint written" in err
    stopped = int((ck / "latest").read_text().split("_")[1])
    assert 3 <= stopped < 400
    resumed = _cli("--steps", str(stopped + 3), "--checkpoint-dir", str(ck), "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    got = _losses(out.splitlines())
    assert sorted(got) == [stopped, stopped + 1, stopped + 2]
    expected = run_on_ranks(2, _train, dataclasses.replace(TINY, steps=stopped + 3))[0][0]
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5)


def test_a_stop_asked_of_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    cfg = dataclasses.replace(TINY, steps=50, checkpoint_dir=str(tmp_path))
    results = run_on_ranks(2, _train, cfg, preempt_after=4)
    # asked after step 4 on rank 0 alone: the flag travels with step 5's loss all-reduce
    assert [r[1] for r in results] == [(5, True), (5, True)]
    assert (tmp_path / "latest").read_text() == "step_000005"


@pytest.mark.slow  # a kill, a restart and a resume: three launches of two fresh ranks
def test_a_killed_rank_under_max_restarts_resumes_from_the_latest_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    job = _cli("--steps", "12", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
               "--max-restarts", "1", "--grace-seconds", "5")
    lines = _read_until_step(job, 5)
    ranks = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True)
    victim = sorted(int(p) for p in ranks.stdout.split())[-1]
    subprocess.run(["kill", "-9", str(victim)], check=True)
    rest, err = job.communicate(timeout=180)
    assert job.returncode == 0, err
    assert "was killed by SIGKILL" in err and "restarting every rank (restart 1 of 1)" in err
    resumed_at = int(re.search(r"resumed from \S+step_(\d+) at step", err)[1])
    assert resumed_at >= 4
    after = _losses(lines + rest.splitlines())  # the resumed attempt's lines come last: they win
    expected = run_on_ranks(2, _train, dataclasses.replace(TINY, steps=12))[0][0]
    for step in range(resumed_at, 12):
        assert after[step] == pytest.approx(expected[step], rel=1e-5)


# -- resume checks (no processes beyond the test pool) ----------------------------------------

def _checkpoint(tmp_path, **changes):
    cfg = dataclasses.replace(TINY, steps=2, checkpoint_dir=str(tmp_path), **changes)
    run_on_ranks(1, _train, cfg)
    return cfg


def test_a_resume_that_differs_lists_every_difference(tmp_path):
    base = _checkpoint(tmp_path)
    other = dataclasses.replace(base, steps=4, resume=True, seed=1, batch_size=4, lr=0.01,
                                n_layer=3, strategy="zero1")
    with pytest.raises(ConfigError) as info:
        validate(other, 1)
    message = str(info.value)
    for part in ("n_layer=2 (this run: 3)", "strategy=ddp (this run: zero1)",
                 "--seed=0 (this run: 1)", "--batch-size=8 (this run: 4)",
                 "--lr=0.003 (this run: 0.01)", "--override"):
        assert part in message, message


def test_override_allows_exactly_what_it_names(tmp_path):
    base = _checkpoint(tmp_path)
    changed = dataclasses.replace(base, steps=4, resume=True, seed=1, lr=0.01)
    validate(dataclasses.replace(changed, override=("seed", "lr")), 1)
    with pytest.raises(ConfigError, match=r"--lr=0.003 \(this run: 0.01\)") as info:
        validate(dataclasses.replace(changed, override=("seed",)), 1)
    assert "--seed" not in str(info.value)


def test_override_names_are_checked(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--override", "seed,colour"])
    assert "unknown name(s) colour" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["tp", "fsdp"])
def test_resume_into_another_strategy_needs_override_and_then_continues_exactly(tmp_path,
                                                                               strategy):
    # the ddp->tp shape RuntimeError and ddp->fsdp IndexError: now a named refusal
    # without --override, and exact continuation with it (pipeline: test_resume_strategies)
    cfg = dataclasses.replace(TINY, steps=2, checkpoint_dir=str(tmp_path))
    run_on_ranks(2, _train, cfg)
    other = dataclasses.replace(cfg, steps=4, resume=True, strategy=strategy)
    with pytest.raises(ConfigError, match="strategy=ddp"):
        validate(other, 2)
    got = run_on_ranks(2, _train, dataclasses.replace(other, override=("strategy",)))[0][0]
    expected = run_on_ranks(2, _train, dataclasses.replace(TINY, steps=4))[0][0]
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        assert got[step] == pytest.approx(expected[step], rel=1e-6)


@pytest.mark.parametrize("pointer", ["../other/step_000040", "/etc", "step_000002/../../x", ""])
def test_latest_may_only_name_a_checkpoint_inside_the_directory(tmp_path, pointer):
    cfg = _checkpoint(tmp_path)
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(ConfigError, match="not a checkpoint directory inside"):
        validate(dataclasses.replace(cfg, steps=4, resume=True), 1)


def _edit_record(path, edit):
    """Rewrite the run's record (a JSON string among the checkpoint metadata's values), with
    the metadata's digest recomputed (else the digest check is what refuses it)."""
    from shardwise.checkpoint.validate import digest_of

    meta = json.loads(path.read_text())
    meta["values"]["train"] = edit(meta["values"]["train"])
    meta["digest"] = digest_of(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(("record", "says"), [
    (None, "damaged or unreadable"), ("{not json", "damaged or unreadable"),
    ("[]", "not a JSON object"), ('{"model": {}}', "no 'strategy' field"),
])
def test_damaged_metadata_names_the_file(tmp_path, record, says):
    cfg = _checkpoint(tmp_path)
    meta = tmp_path / "step_000002" / "metadata.json"
    if record is None:
        meta.write_text("{not json")
    else:
        _edit_record(meta, lambda _: record)
    with pytest.raises(ConfigError) as info:
        validate(dataclasses.replace(cfg, steps=4, resume=True), 1)
    assert str(meta) in str(info.value) and says in str(info.value)


def test_a_wrong_field_type_in_metadata_names_the_field(tmp_path):
    cfg = _checkpoint(tmp_path)

    def step_as_text(text):
        record = json.loads(text)
        record["step"] = "two"
        return json.dumps(record)

    _edit_record(tmp_path / "step_000002" / "metadata.json", step_as_text)
    with pytest.raises(ConfigError, match="'step' must be int, got 'two'"):
        validate(dataclasses.replace(cfg, steps=4, resume=True), 1)


def test_leftovers_of_a_crashed_save_are_removed_and_keep_prunes(tmp_path):
    (tmp_path / "step_000007.tmp").mkdir()
    (tmp_path / "step_000007.tmp" / "rank_00000.bin").write_text("half")
    (tmp_path / "step_000003.old-1f2e").mkdir()
    (tmp_path / "latest.tmp-4242").write_text("step_0000")
    cfg = dataclasses.replace(TINY, steps=5, checkpoint_every=1, keep=2,
                              checkpoint_dir=str(tmp_path))
    run_on_ranks(1, _train, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000005"]


def test_keep_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--keep", "-1"])
    assert "--keep must be at least 0, got -1" in capsys.readouterr().err


def test_a_truncated_checkpoint_file_is_a_checkpoint_error_naming_it(tmp_path):
    cfg = _checkpoint(tmp_path)
    data = tmp_path / "step_000002" / "rank_00000.bin"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(RankFailure, match=r"cannot be loaded by this run: .*rank_00000\.bin"):
        run_on_ranks(1, _train, dataclasses.replace(cfg, steps=4, resume=True))


def test_tensor_parallel_resume_reproduces_the_uninterrupted_losses(tmp_path):
    straight = dataclasses.replace(TINY, steps=4, strategy="tp")
    first = dataclasses.replace(straight, steps=2, checkpoint_dir=str(tmp_path))
    expected = run_on_ranks(2, _train, straight)[0][0]
    run_on_ranks(2, _train, first)
    got = run_on_ranks(2, _train, dataclasses.replace(first, steps=4, resume=True))[0][0]
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        assert got[step] == pytest.approx(expected[step], rel=1e-5)
