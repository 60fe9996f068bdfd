"""Damaged and hostile checkpoints (issue 25 point 5): every reader (``load``, ``shardwise train
--resume`` and the train loop's resume, ``shardwise checkpoint inspect`` and ``export``) refuses
each with a named error before anything is allocated or read; export verifies every CRC; no
temporary file of a checkpoint write follows a planted link.

One checkpoint is written per session (``shardwise train``, FSDP at 2 ranks: every tensor in two
chunks, one per rank file) and each test damages a copy of it. Metadata damage is "re-signed"
(its digest recomputed, as an attacker who reads the source would) except where the digest
itself is what the case checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

from shardwise.checkpoint import CheckpointError, export_safetensors, inspect, load, read_meta
from shardwise.checkpoint.train_state import mark_latest
from shardwise.checkpoint.validate import read_metadata
from shardwise.cli.main import main
from tests.cli.test_resume_strategies import TINY
from tests.harness import run_on_ranks

STEP = "step_000002"
W = "model.blocks.0.mlp.fc1.weight"  # (128, 32): [0:64] in rank_00000.bin, [64:128] in _00001
HUGE = 2 ** 36


def _train(ctx, cfg):
    from shardwise.cli.train_args import validate
    from shardwise.cli.train_loop import train

    validate(cfg, ctx.world_size)
    return train(cfg, ctx.group, torch.device("cpu")).losses


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run")
    cfg = dataclasses.replace(TINY, steps=2, strategy="fsdp", checkpoint_dir=str(path))
    run_on_ranks(2, _train, cfg)
    return path / STEP


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _rewrite(step: Path, change, sign: bool = True) -> None:
    meta_file = step / "metadata.json"
    meta = json.loads(meta_file.read_text())
    change(meta)
    if sign and isinstance(meta, dict):
        meta["digest"] = _digest(meta)
    meta_file.write_text(json.dumps(meta))


def _chunks(meta: dict, name: str = W) -> list[dict]:
    return meta["tensors"][name]["chunks"]


def _swap_boxes(meta):
    a, b = _chunks(meta)
    a["offsets"], b["offsets"] = b["offsets"], a["offsets"]


def _overlap(meta):
    _chunks(meta)[1]["offsets"][0] -= 1  # rows 63..127: row 63 twice, row 127 never


def _gap(meta):
    del _chunks(meta)[1]


def _negative_offset(meta):
    _chunks(meta)[0]["offsets"][0] = -64


def _negative_size(meta):
    _chunks(meta)[0]["sizes"][1] = -32


def _negative_byte_offset(meta):
    _chunks(meta)[0]["byte_offset"] = -4


def _huge(meta):
    """2^36 rows, the chunks tiling them and their byte counts consistent."""
    t = meta["tensors"][W]
    t["shape"][0] = HUGE
    half = HUGE // 2
    for i, c in enumerate(t["chunks"]):
        c["offsets"][0], c["sizes"][0] = i * half, half
        c["nbytes"] = half * 32 * 4
        c["block_rows"] = half


def _huge_files(meta):
    _huge(meta)
    meta["files"] = {name: HUGE * 128 for name in meta["files"]}


def _no_chunks(meta):
    _chunks(meta).clear()


def _to_file(name):
    def change(meta):
        for c in _chunks(meta):
            if c["file"] == "rank_00001.bin":
                c["file"] = name
        meta["files"][name] = meta["files"].pop("rank_00001.bin")
    return change


def _del_files(meta):
    del meta["files"]


def _int_file(meta):
    _chunks(meta)[0]["file"] = 7


def _tensors_list(meta):
    meta["tensors"] = list(meta["tensors"].values())


def _bool_offset(meta):
    _chunks(meta)[0]["byte_offset"] = True


def _unknown_dtype(meta):
    meta["tensors"][W]["dtype"] = "object"


def _crc_text(meta):
    _chunks(meta)[0]["crc32"] = ["0"]


def _symlink_step(run: Path, step: Path) -> None:
    other = run.parent / "other_run"
    shutil.move(step, other)
    step.symlink_to(other, target_is_directory=True)


def _symlink_data(run: Path, step: Path) -> None:
    moved = run.parent / "elsewhere.bin"
    shutil.move(step / "rank_00001.bin", moved)
    (step / "rank_00001.bin").symlink_to(moved)


def _symlink_metadata(run: Path, step: Path) -> None:
    moved = run.parent / "elsewhere.json"
    shutil.move(step / "metadata.json", moved)
    (step / "metadata.json").symlink_to(moved)


def _outside_file(run: Path, step: Path, name: str) -> None:
    """A chunk file outside the step directory, with the right bytes (so the CRCs match)."""
    target = (step / name).resolve() if not os.path.isabs(name) else Path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(step / "rank_00001.bin", target)


def _traversal(run: Path, step: Path) -> None:
    name = "../outside_rank_00001.bin"
    _outside_file(run, step, name)
    _rewrite(step, _to_file(name))


def _absolute(run: Path, step: Path) -> None:
    name = str(run.parent / "abs" / "rank_00001.bin")
    _outside_file(run, step, name)
    _rewrite(step, _to_file(name))


def _deep_nesting(run: Path, step: Path) -> None:
    text = (step / "metadata.json").read_text()
    (step / "metadata.json").write_text(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000
                                        + "}")


def _long_int_literal(run: Path, step: Path) -> None:
    text = (step / "metadata.json").read_text()
    (step / "metadata.json").write_text(text.replace('"world_size": 2', '"world_size": '
                                                     + "9" * 5000))


def _meta(change, sign=True):
    return lambda run, step: _rewrite(step, change, sign)


# (case id, damage(run_dir, step_dir), what the error says)
CASES = [
    ("swapped-boxes", _meta(_swap_boxes, sign=False), r"digest does not match"),
    ("edited-unsigned", _meta(lambda m: m["values"].update(train="{}"), sign=False),
     r"digest does not match"),
    ("overlap", _meta(_overlap), r"overlap"),
    ("gap", _meta(_gap), r"cover \d+ of the 4096 elements"),
    ("negative-offset", _meta(_negative_offset), r"offsets\[0\].*>= 0, got -64"),
    ("negative-size", _meta(_negative_size), r"sizes\[1\].*>= 0, got -32"),
    ("negative-byte-offset", _meta(_negative_byte_offset), r"byte_offset.*>= 0, got -4"),
    ("traversal", _traversal, r"not a plain file name"),
    ("absolute", _absolute, r"not a plain file name"),
    ("symlinked-step-dir", _symlink_step, r"symbolic link"),
    ("symlinked-data-file", _symlink_data, r"symbolic link"),
    ("symlinked-metadata", _symlink_metadata, r"symbolic link"),
    ("huge-sizes", _meta(_huge), r"bytes \d+\.\.\d+ of rank_0000\d\.bin, which has \d+ bytes"),
    ("huge-files", _meta(_huge_files), r"rank_0000\d\.bin .*it has \d+ bytes on disk, the "
                                       r"metadata declares 8796093022208"),
    ("no-chunks", _meta(_no_chunks), r"cover 0 of the 4096 elements"),
    ("missing-files", _meta(_del_files), r"no 'files'"),
    ("integer-file-name", _meta(_int_file), r"file: expected a string, got 7"),
    ("tensors-as-list", _meta(_tensors_list), r"'tensors': expected an object"),
    ("bool-offset", _meta(_bool_offset), r"byte_offset: expected an int >= 0, got True"),
    ("unknown-dtype", _meta(_unknown_dtype), r"unknown dtype 'object'"),
    ("crc-as-text", _meta(_crc_text), r"crc32\[0\]: expected an int"),
    ("deep-nesting", _deep_nesting, r"metadata.json is damaged or unreadable: .*nest"),
    ("long-int-literal", _long_int_literal, r"metadata.json is damaged or unreadable: .*digits"),
]
IDS = [c[0] for c in CASES]


@pytest.fixture
def damaged(request, pristine, tmp_path):
    """A run directory (``latest`` -> step_000002) whose checkpoint has one case's damage."""
    _, damage, says = request.param
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(pristine, run / STEP)
    (run / "latest").write_text(STEP)
    damage(run, run / STEP)
    return run, says


def _target(pristine: Path) -> dict:
    meta = json.loads((pristine / "metadata.json").read_text())
    model = {k[len("model."):]: torch.zeros(t["shape"]) for k, t in meta["tensors"].items()
             if k.startswith("model.")}
    return {"model": model}


@contextlib.contextmanager
def _no_large_allocation(limit: int = 1 << 30):
    """Fail the test if anything asks torch for a tensor of more than ``limit`` bytes."""
    real_empty, real_zeros = torch.empty, torch.zeros

    def guard(real):
        def make(*size, **kwargs):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            n = 1
            for d in shape:
                n *= int(d)
            if n > limit:
                raise AssertionError(f"a tensor of {n} elements was allocated")
            return real(*size, **kwargs)
        return make

    with mock.patch.object(torch, "empty", guard(real_empty)), \
            mock.patch.object(torch, "zeros", guard(real_zeros)):
        yield


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.err


def _one_line_error(code: int, err: str, prefix: str, says: str) -> None:
    import re

    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert re.search(says, lines[0]), (says, err)


@pytest.mark.parametrize("damaged", CASES, ids=IDS, indirect=True)
def test_load_refuses(damaged, pristine):
    run, says = damaged
    target = _target(pristine)
    before = {k: v.clone() for k, v in target["model"].items()}
    with _no_large_allocation(), pytest.raises(CheckpointError, match=says):
        load(target, checkpoint_id=run / STEP)
    for k, v in target["model"].items():  # nothing was read into the destination
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("damaged", CASES, ids=IDS, indirect=True)
def test_validator_refuses_before_any_read(damaged):
    """``read_metadata`` (what every reader calls first) raises; nothing else ran."""
    run, says = damaged
    with _no_large_allocation(), pytest.raises(CheckpointError, match=says):
        read_metadata(run / STEP)
    with pytest.raises(CheckpointError, match=says):
        inspect(run / STEP)


@pytest.mark.parametrize("damaged", CASES, ids=IDS, indirect=True)
def test_resume_refuses(damaged, capsys):
    """``shardwise train --resume``: one line, exit code 2, before any rank starts."""
    run, says = damaged
    with pytest.raises(CheckpointError, match=says):
        read_meta(run / STEP)
    code, err = _cli(capsys, "train", "--checkpoint-dir", str(run), "--resume", "--nproc", "1",
                     "--steps", "4", "--n-layer", "2", "--n-head", "4", "--d-model", "32",
                     "--seq-len", "16", "--batch-size", "8")
    _one_line_error(code, err, "shardwise train: error:", says)


@pytest.mark.parametrize("damaged", CASES, ids=IDS, indirect=True)
def test_cli_inspect_and_export_refuse(damaged, capsys, tmp_path):
    run, says = damaged
    out = tmp_path / "out.safetensors"
    for target in (run, run / STEP):  # the run's directory (its latest) and the step itself
        code, err = _cli(capsys, "checkpoint", "inspect", str(target))
        _one_line_error(code, err, "shardwise checkpoint: error:", says)
        with _no_large_allocation():
            code, err = _cli(capsys, "checkpoint", "export", str(target), str(out))
        _one_line_error(code, err, "shardwise checkpoint: error:", says)
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.safetensors")]


def _resume_in_loop(ctx, cfgs):
    """The train loop's own resume (no CLI validation before it): each run's error."""
    from shardwise.cli.train_loop import train

    errors = []
    for cfg in cfgs:
        try:
            train(cfg, ctx.group, torch.device("cpu"))
            errors.append(None)
        except CheckpointError as exc:
            errors.append(str(exc))
    return errors


def test_train_loop_resume_refuses_every_case(pristine, tmp_path):
    import re

    cfgs, wanted = [], []
    for case_id, damage, says in CASES:
        run = tmp_path / case_id / "run"
        run.mkdir(parents=True)
        shutil.copytree(pristine, run / STEP)
        (run / "latest").write_text(STEP)
        damage(run, run / STEP)
        cfgs.append(dataclasses.replace(TINY, steps=4, strategy="fsdp", resume=True,
                                        checkpoint_dir=str(run)))
        wanted.append(says)
    errors = run_on_ranks(1, _resume_in_loop, cfgs)[0]
    for (case_id, _, _), says, err in zip(CASES, wanted, errors):
        assert err is not None and re.search(says, err), (case_id, err)


def test_pristine_copy_still_loads(pristine, tmp_path):
    """The fixture's checkpoint itself passes every check (the cases above are the damage)."""
    run = tmp_path / "run"
    shutil.copytree(pristine, run / STEP)
    target = _target(pristine)
    load(target, checkpoint_id=run / STEP)
    assert any(v.abs().sum() > 0 for v in target["model"].values())
    export_safetensors(run / STEP, tmp_path / "m.safetensors")


def _flip_data_byte(step: Path) -> None:
    meta = json.loads((step / "metadata.json").read_text())
    rec = _chunks(meta)[1]
    data = step / rec["file"]
    raw = bytearray(data.read_bytes())
    raw[rec["byte_offset"] + 7] ^= 0x10
    data.write_bytes(bytes(raw))


def test_export_verifies_crcs(pristine, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(pristine, run / STEP)
    _flip_data_byte(run / STEP)
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=r"rank_00001\.bin is corrupt: tensor "
                                              + W.replace(".", r"\.")):
        export_safetensors(run / STEP, out)
    code, err = _cli(capsys, "checkpoint", "export", str(run / STEP), str(out))
    _one_line_error(code, err, "shardwise checkpoint: error:", r"corrupt.*CRC-32")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary file left


def test_export_temp_file_does_not_follow_a_planted_link(pristine, tmp_path):
    """Another user plants symlinks at the temporary names an export might use: the victim's
    file is unchanged and the export lands at its own name."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.safetensors"
    for name in ("out.safetensors.tmp", f"out.safetensors.tmp-{os.getpid()}"):
        (tmp_path / name).symlink_to(victim)
    export_safetensors(pristine, out)
    assert victim.read_text() == "precious"
    assert not out.is_symlink() and out.stat().st_size > 1000
    from safetensors.torch import load_file

    assert W[len("model."):] in load_file(str(out))


def test_latest_temp_file_does_not_follow_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest.tmp").symlink_to(victim)
    (run / f"latest.tmp-{os.getpid()}").symlink_to(victim)
    mark_latest(run, run / STEP)
    assert victim.read_text() == "precious"
    assert (run / "latest").read_text() == STEP and not (run / "latest").is_symlink()


def test_save_into_a_planted_tmp_dir_link_refused(tmp_path):
    """``<id>.tmp`` planted as a link to another user's directory: the save fails and writes
    nothing there."""
    from shardwise.checkpoint import save

    victim = tmp_path / "victim_dir"
    victim.mkdir()
    (tmp_path / "ck.tmp").symlink_to(victim, target_is_directory=True)
    with pytest.raises(CheckpointError):
        save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "ck")
    assert list(victim.iterdir()) == []
    assert not (tmp_path / "ck").exists()
