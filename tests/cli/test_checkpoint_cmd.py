"""`shardwise checkpoint inspect DIR` and `shardwise checkpoint export DIR OUT.safetensors` on a
checkpoint written by `shardwise train` (FSDP at 2 ranks), and their errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import load
from shardwise.cli.main import main
from shardwise.models import GPT
from tests.cli.test_resume_strategies import TINY, _train
from tests.harness import run_on_ranks


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    cfg = dataclasses.replace(TINY, steps=2, strategy="fsdp", checkpoint_dir=str(path))
    run_on_ranks(2, _train, cfg)
    return path


def _cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(["checkpoint", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_lists_names_shapes_dtypes_and_shards(capsys, run_dir):
    code, out, _ = _cli(capsys, "inspect", str(run_dir))  # the run's directory: its latest
    assert code == 0
    assert out.startswith(f"checkpoint {run_dir / 'step_000002'}: saved by 2 rank(s)")
    lines = {line.split()[0]: " ".join(line.split()) for line in out.splitlines()[1:]}
    assert lines["model.blocks.0.mlp.fc1.weight"] == (
        "model.blocks.0.mlp.fc1.weight (128, 32) float32 2 chunks on dim 0: "
        "[0:64, 0:32] rank_00000.bin, [64:128, 0:32] rank_00001.bin")
    assert lines["optim.state.blocks.0.mlp.fc1.weight.exp_avg"].startswith(
        "optim.state.blocks.0.mlp.fc1.weight.exp_avg (128, 32) float32 2 chunks on dim 0")
    assert lines["optim.state.blocks.0.mlp.fc1.weight.step"] == (
        "optim.state.blocks.0.mlp.fc1.weight.step () float32 whole in rank_00000.bin")
    assert lines["train"].startswith('train = "{\\"model\\": {')
    code, again, _ = _cli(capsys, "inspect", str(run_dir / "step_000002"))
    assert code == 0 and again == out


def test_export_loads_with_safetensors_into_the_plain_model(capsys, run_dir, tmp_path):
    out_file = tmp_path / "model.safetensors"
    code, out, err = _cli(capsys, "export", str(run_dir), str(out_file))
    assert code == 0, err
    exported = load_file(str(out_file))
    model = GPT(TINY.model_config())
    model.load_state_dict(exported, strict=True)
    # the same numbers as loading the sharded checkpoint into the plain model in one process
    reference = GPT(TINY.model_config())
    state = {"model": reference.state_dict()}
    load(state, checkpoint_id=run_dir / "step_000002")
    assert exported.keys() == state["model"].keys()
    for name, value in state["model"].items():
        assert torch.equal(exported[name], value), name
    assert f"wrote {len(exported)} tensors" in out


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p / "absent", "no checkpoint at"),
    (lambda p: (p / "half.tmp").mkdir() or p / "half", "incomplete: a save did not finish"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "incomplete or not a sharded checkpoint"),
])
def test_bad_directories_are_clear_errors(capsys, tmp_path, make, says):
    target = make(tmp_path)
    for argv in (["inspect", str(target)], ["export", str(target), str(tmp_path / "o.st")]):
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and "shardwise checkpoint: error:" in err and says in err, err
