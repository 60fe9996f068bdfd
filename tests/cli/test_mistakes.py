"""Mistakes a newcomer makes, each refused by the launching process in one line on stderr,
exit 2, before any rank starts: values that only the ranks used to check (heads against the
tensor-parallel degree, layers against stages, batch against ranks and micro-batches, mesh
sizes), malformed environment variables, and MASTER_ADDR / MASTER_PORT."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.env_check import CHECKED, NOT_CHECKED
from shardwise.cli.main import main
from shardwise.distributed.env import EnvError
from tests.harness import procs

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"

ARGS = [
    (["--strategy", "tp", "--nproc", "3", "--batch-size", "12"],
     "--strategy tp: the world size 3 does not divide --n-head 4"),
    (["--strategy", "fsdp", "--tp", "3", "--nproc", "3", "--batch-size", "12"],
     "--tp 3 does not divide --n-head 4"),
    (["--strategy", "fsdp", "--tp", "2", "--nproc", "3", "--batch-size", "12"],
     "--tp 2 does not divide the world size 3"),
    (["--strategy", "hsdp", "--replicas", "3", "--nproc", "4"], "3 replicas do not divide"),
    (["--strategy", "ddp", "--tp", "2"], "--tp is for --strategy fsdp"),
    (["--strategy", "fsdp", "--replicas", "2"], "--replicas is for --strategy hsdp"),
    (["--strategy", "pipeline", "--nproc", "4", "--n-layer", "1"], "needs at least 2 layers"),
    (["--strategy", "pipeline", "--microbatches", "3"], "not divisible by --microbatches 3"),
    (["--strategy", "pipeline", "--nproc", "4", "--dp", "3"], "--dp 3 does not divide"),
    (["--nproc", "4", "--batch-size", "2"], "smaller than the world size 4"),
    (["--nproc", "3", "--batch-size", "16"], "not divisible by the world size 3"),
    (["--n-head", "3"], "d_model (128) must be divisible by n_head (3)"),
    (["--microbatches", "4"], "--microbatches only apply to --strategy pipeline"),
    (["--step", "2"], "did you mean --steps?"),
]

ENV = [({name: value}, name) for name, value in (
    ("SHARDWISE_TIMEOUT", "abc"), ("SHARDWISE_TIMEOUT", "-1"), ("SHARDWISE_GRACE_SECONDS", "x"),
    ("SHARDWISE_NO_PEER_READ", "maybe"), ("SHARDWISE_NO_SHM_REDUCE", "2"),
    ("SHARDWISE_FSDP_NO_SHARED_PARAMS", "on"), ("SHARDWISE_RPC_CHANNEL", "udp"),
    ("SHARDWISE_RPC_SHM_POOL_MB", "lots"), ("SHARDWISE_RPC_SPIN_US", "-3"),
    ("SHARDWISE_CHECKPOINT_MAX_METADATA_BYTES", "0"),
    ("MASTER_PORT", "x"), ("MASTER_PORT", "70000"))] + [
    ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not"),
]


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("a mistake reached the launcher")

    monkeypatch.setattr("shardwise.cli.launch_args.launch", never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('ran')\n")
    for name in [*CHECKED, "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(name, raising=False)


def _one_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(argv))
    out, err = capsys.readouterr()
    assert info.value.code == 2, (argv, err)
    assert "Traceback" not in out + err and out == "", (argv, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise {argv[0]}: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,says", ARGS, ids=lambda a: " ".join(a) if isinstance(a, list)
                         else None)
def test_a_bad_value_is_refused_before_any_rank(capsys, argv, says):
    assert says in _one_line(capsys, ["train", *argv])


@pytest.mark.parametrize("env,name", ENV, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items())
                         if isinstance(e, dict) else None)
@pytest.mark.parametrize("command", [["train", "--steps", "2"], ["run", "x.py"]],
                         ids=lambda c: c[0])
def test_a_malformed_variable_is_one_line_naming_it(capsys, monkeypatch, env, name, command):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = _one_line(capsys, command)
    assert name in line and ("must be" in line or "is not" in line), line


def test_the_ranks_run_the_launchers_heads_check():
    """One function: the message a rank raises where it shards is the launcher's."""
    from shardwise.cli.strategy_tp import check_gpt
    from shardwise.models import GPT, GPTConfig

    with pytest.raises(ValueError, match="^--strategy tp: the world size 3 does not divide "
                                         "--n-head 4: every tensor-parallel rank"):
        check_gpt(GPT(GPTConfig(n_layer=1, d_model=8, seq_len=4)), 3)


def test_every_shardwise_variable_is_checked_or_named_free_form():
    named = {m for path in SRC.rglob("*.py")
             for m in re.findall(r"\"(SHARDWISE_[A-Z0-9_]+)\"", path.read_text())}
    assert named - set(CHECKED) - set(NOT_CHECKED) == set()
    assert set(CHECKED) <= named and not set(CHECKED) & set(NOT_CHECKED)


def test_the_checks_agree_with_the_librarys_readers(monkeypatch):
    from shardwise.rpc.wire.shm_channel import MODES, channel_mode

    for mode in MODES:
        monkeypatch.setenv("SHARDWISE_RPC_CHANNEL", mode)
        assert CHECKED["SHARDWISE_RPC_CHANNEL"]() == channel_mode()
    monkeypatch.setenv("SHARDWISE_RPC_CHANNEL", "udp")
    with pytest.raises(EnvError):
        channel_mode()


def test_master_port_disagreeing_with_the_endpoint_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29400")
    line = _one_line(capsys, ["run", "--rdzv-endpoint", "127.0.0.1:29401", "x.py"])
    assert "--rdzv-endpoint 127.0.0.1:29401 and MASTER_ADDR:MASTER_PORT (127.0.0.1:29400)" in line


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", **extra,
                PYTHONPATH=os.pathsep.join([str(procs.ROOT), str(procs.ROOT / "src")]))


@pytest.mark.parametrize("argv,env", [
    (["train", "--strategy", "tp", "--nproc", "3", "--batch-size", "12"], {}),
    (["train", "--steps", "2"], {"SHARDWISE_TIMEOUT": "abc"}),
    (["run", "x.py"], {"MASTER_PORT": "x"}),
], ids=["tp-heads", "timeout", "master-port"])
def test_the_launching_program_prints_one_line_and_starts_no_rank(tmp_path, argv, env):
    (tmp_path / "x.py").write_text("print('ran', flush=True)\n")
    done = subprocess.run([sys.executable, "-m", "shardwise", *argv], env=_env(**env),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise {argv[0]}: error: "), done.stderr


def test_master_addr_and_port_are_where_the_ranks_rendezvous(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: the launcher's store binds it
    (tmp_path / "x.py").write_text(
        "import os\nprint(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], flush=True)\n")
    done = subprocess.run([sys.executable, "-m", "shardwise", "run", "--nproc", "2", "x.py"],
                          env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[rank{r}]: 127.0.0.1 {port}" for r in (0, 1)]
