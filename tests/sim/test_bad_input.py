"""`shardwise plan --simulate` on bad input: one line on stderr, exit code 2, no traceback, and
no dry run started. (tests/sim/test_plan_simulate.py has the demo GPT's mesh, heads and rank
cases; these are the config files, the heads of a config file, and the checkpoint flags.)"""

from __future__ import annotations

import json

import pytest

from shardwise.cli.main import main
from tests.sim.configs import LLAMA, llama_file


def _error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--simulate", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert captured.out == ""
    return err


@pytest.mark.parametrize("content, message", [
    (json.dumps({"hidden_size": 64, "layers": 2}), "missing field 'model_type'"),
    (json.dumps({**LLAMA, "hidden_size": "big"}), "field 'hidden_size' must be a positive"),
    (json.dumps({**LLAMA, "num_hidden_layers": None}), "missing field 'num_hidden_layers'"),
    (json.dumps([1, 2, 3]), "holds a JSON list, not an object"),
    ("this is not JSON {", "is not JSON"),
    ("", "is not JSON"),
])
def test_a_config_file_that_is_not_a_model_config(content, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(content)
    err = _error(capsys, "--hf-config", str(path), "--nproc", "64")
    assert message in err and str(path) in err


def test_a_missing_config_file(tmp_path, capsys):
    path = tmp_path / "nowhere.json"
    err = _error(capsys, "--hf-config", str(path), "--nproc", "64")
    assert f"cannot read {path}" in err


def test_a_directory_given_as_config(tmp_path, capsys):
    err = _error(capsys, "--hf-config", str(tmp_path), "--nproc", "64")
    assert f"cannot read {tmp_path}" in err


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp 3 must divide n_head (8)"),
    (["--replicas", "3"], "not divisible by replicas"),
    (["--tp", "4", "--replicas", "3"], "replicas"),
])
def test_a_config_file_s_mesh_that_does_not_factor(argv, message, tmp_path, capsys):
    err = _error(capsys, "--hf-config", str(llama_file(tmp_path)), "--nproc", "64", *argv)
    assert message in err


@pytest.mark.parametrize("argv, message", [
    (["--reshard-to", "0"], "--reshard-to must be at least 1, got 0"),
    (["--reshard-to", "two"], "--reshard-to must be an integer, got 'two'"),
    (["--rank", "5", "--reshard-to", "4"], "--rank 5 is outside the --reshard-to world of 4"),
    (["--strategy", "hsdp", "--replicas", "2", "--reshard-to", "3"],
     "cannot factor the world size: 3 ranks"),
])
def test_bad_checkpoint_flags(argv, message, tmp_path, capsys):
    err = _error(capsys, "--hf-config", str(llama_file(tmp_path)), "--nproc", "8", *argv)
    assert message in err


def test_reshard_to_without_simulate(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--nproc", "8", "--reshard-to", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--reshard-to plans a checkpoint in the dry run: it needs --simulate" in err
    assert "\n" not in err
