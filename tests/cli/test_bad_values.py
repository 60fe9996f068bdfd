"""Every bad or extreme value on the command line is one line: exit code 2,
``shardwise <cmd>: error: ...`` on stderr, no traceback, before any rank starts.

The values are those a review found ending in a traceback, a hang or silence (issue 25, point
7), with their neighbours (0, -1, the limit and one past it, nan, inf, a non-number). They run
in-process through ``main(argv)`` (parsing and validation happen before any process starts);
two run as real programs, to see the one line of the launching process.
"""

from __future__ import annotations

import os

import pytest
import torch

from shardwise.cli.launch_args import target_problem
from shardwise.cli.main import _parser, main
from shardwise.cli.ranges import MAX_COUNT, MAX_LAYERS, MAX_LR, MAX_SEED, max_local_ranks
from tests.harness.ports import closed_port

OVER = str(MAX_COUNT + 1)
NEIGHBOURS = ["0", "-1", OVER, "nan", "inf", "x", "1.5"]

TRAIN = [[flag, value] for flag in ("--nproc", "--n-layer", "--n-head", "--d-model", "--seq-len",
                                     "--steps", "--batch-size", "--eval-batches", "--log-every",
                                     "--microbatches", "--tp")
         for value in NEIGHBOURS] + [
    ["--n-layer", "1000000000"], ["--n-layer", str(MAX_LAYERS + 1)], ["--d-model", "10000000"],
    ["--seq-len", "1000000000"], ["--n-layer", "64", "--d-model", "1000000"],
    ["--lr", "1e308"], ["--lr", "0"], ["--lr", "-1"], ["--lr", "nan"], ["--lr", "inf"],
    ["--lr", "x"], ["--lr", str(MAX_LR * 1.001)],
    ["--seed", str(2**70)], ["--seed", "2**70"], ["--seed", "-1"], ["--seed", str(MAX_SEED + 1)],
    ["--seed", "nan"], ["--batch-size", "1e12"], ["--batch-size", str(10**12)],
    ["--corpus-bytes", "1"], ["--corpus-bytes", str(10**15)], ["--corpus-bytes", "1e15"],
    ["--corpus-bytes", str(2**30 + 1)], ["--corpus-bytes", "0"], ["--corpus-bytes", "-1"],
    ["--corpus-bytes", "nan"], ["--corpus-bytes", "x"],
    ["--warmup", "-5"], ["--warmup", "-1"], ["--warmup", OVER], ["--checkpoint-every", "-5"],
    ["--checkpoint-every", "-1"], ["--keep", "-1"], ["--replicas", "-1"],
    ["--checkpoint-dir", ""], ["--checkpoint-dir", "  "], ["--log-dir", ""],
    ["--mixed-precision", "bf16"], ["--cpu-offload"],
    ["--strategy", "zero1", "--mixed-precision", "fp16"], ["--strategy", "tp", "--cpu-offload"],
    ["--nproc", "1000"], ["--nproc", str(max_local_ranks() + 1)],
    ["--grace-seconds", "0"], ["--grace-seconds", "-1"], ["--grace-seconds", "nan"],
    ["--grace-seconds", "inf"], ["--max-restarts", "-1"], ["--nnodes", "0"],
    ["--node-rank", "-1"], ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
    ["--device", "tpu"],
]

PLAN = [["--params", v] for v in ("1e400", "1e30", "1e16", "0", "-1", "nan", "inf", "x")] + [
    ["--memory-gib", v] for v in ("nan", "inf", "-inf", "0", "-1", "x", str(2**30 + 1))] + [
    ["--nproc", v] for v in ("1e12", str(10**12), "0", "-1", str(2**24 + 1), "nan")] + [
    ["--n-layer", str(MAX_LAYERS + 1)], ["--n-layer", "0"], ["--d-model", str(2**20 + 1)],
    ["--seq-len", "0"], ["--batch-size", "-1"], ["--tp", "0"], ["--tp", "2,0"],
    ["--replicas", "0"], ["--vocab-size", OVER],
]

RUN = [["--nproc", v, "x.py"] for v in ("1000", "0", "-1", "nan", "x")] + [
    ["--nproc", str(max_local_ranks() + 1), "x.py"],
    ["/nonexistent/script.py"], ["-m", "no_such_module_h6"], ["-m", "json.no_such_part"],
    ["-m", "json"], ["-m", "not-a-name"], ["src"], ["--grace-seconds", "nan", "x.py"],
    ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "no-port", "x.py"],
]

BENCH = [["ddp", flag, v] for flag in ("--nproc", "--rounds", "--steps", "--n-layer", "--d-model",
                                      "--batch-size") for v in NEIGHBOURS] + [
    ["ddp", "--nproc", str(max_local_ranks() + 1)], ["ddp", "--warmup", "-1"],
    ["ddp", "--d-model", "10000000"], ["ddp", "--bucket-cap-mb", "nan"],
    ["collectives", "--mib", "1000000000"], ["rpc", "--big-mb", "0"], ["nosuch", "--nproc", "2"],
]

CHECKPOINT = [[], ["export"], ["inspect"], ["export", "/nonexistent/ck", "out.safetensors"],
              ["inspect", "/nonexistent/ck"], ["frobnicate", "x"]]


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        code = main(argv)
        raise SystemExit(code)
    captured = capsys.readouterr()
    err = captured.err
    assert info.value.code == 2, (argv, info.value.code, err)
    assert "Traceback" not in err + captured.out, (argv, err)
    lines = err.splitlines()
    assert len(lines) == 1, (argv, err)
    prog, sep, _ = lines[0].partition(": error: ")
    assert sep and prog.startswith(f"shardwise {argv[0]}"), (argv, err)  # (or its subcommand)
    return lines[0]


def _never_launch(*args, **kwargs):
    raise AssertionError("a bad value reached the launcher")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr("shardwise.cli.launch_args.launch", _never_launch)
    monkeypatch.chdir(tmp_path)  # (x.py, the directory src: resolved here)
    (tmp_path / "x.py").write_text("print('ran')\n")
    (tmp_path / "src").mkdir()


@pytest.mark.parametrize("argv", TRAIN, ids=" ".join)
def test_train_bad_value_is_one_line(capsys, argv):
    _error_line(capsys, ["train", *argv])


@pytest.mark.parametrize("argv", PLAN, ids=" ".join)
def test_plan_bad_value_is_one_line(capsys, argv):
    _error_line(capsys, ["plan", *argv])


@pytest.mark.parametrize("argv", RUN, ids=" ".join)
def test_run_bad_value_is_one_line(capsys, argv):
    _error_line(capsys, ["run", *argv])


@pytest.mark.parametrize("argv", BENCH, ids=" ".join)
def test_bench_bad_value_is_one_line(capsys, argv):
    _error_line(capsys, ["bench", *argv])


@pytest.mark.parametrize("argv", CHECKPOINT, ids=" ".join)
def test_checkpoint_bad_value_is_one_line(capsys, argv):
    _error_line(capsys, ["checkpoint", *argv])


def test_messages_name_the_limit(capsys):
    assert f"at most {MAX_SEED}" in _error_line(capsys, ["train", "--seed", str(2**70)])
    assert "at least 0, got -5" in _error_line(capsys, ["train", "--warmup", "-5"])
    assert "at most 1000" in _error_line(capsys, ["train", "--lr", "1e308"])
    line = _error_line(capsys, ["run", "--nproc", "1000", "x.py"])
    assert f"at most {max_local_ranks()}" in line
    assert f"at most {MAX_LAYERS}" in _error_line(capsys, ["train", "--n-layer", "1000000000"])
    line = _error_line(capsys, ["train", "--n-layer", "8", "--d-model", "10000000"])
    assert "too large for this machine" in line and "the machine has" in line
    line = _error_line(capsys, ["train", "--mixed-precision", "bf16"])
    assert "--mixed-precision applies to --strategy fsdp or hsdp only, not ddp" in line
    assert "does not exist" in _error_line(capsys, ["run", "/nonexistent/script.py"])
    assert "is a directory" in _error_line(capsys, ["run", "src"])
    assert "no module named 'no_such_module_h6'" in _error_line(
        capsys, ["run", "-m", "no_such_module_h6"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_says_so_once(capsys):
    line = _error_line(capsys, ["train", "--device", "cuda"])
    assert "no CUDA device is available" in line


@pytest.mark.parametrize("argv", [
    ["train", "--seed", str(MAX_SEED)], ["train", "--seed", "0"],
    ["train", "--lr", str(MAX_LR)], ["train", "--warmup", "0"],
    ["train", "--checkpoint-every", "0"], ["train", "--corpus-bytes", str(2**30)],
    ["train", "--steps", str(MAX_COUNT)], ["run", "--nproc", str(max_local_ranks()), "x.py"],
    ["plan", "--params", "1e15"], ["plan", "--memory-gib", str(2**30)],
    ["plan", "--nproc", str(2**24)], ["plan", "--n-layer", str(MAX_LAYERS)],
    ["train", "--n-layer", str(MAX_LAYERS)],
], ids=" ".join)
def test_the_limits_themselves_parse(argv):
    _parser().parse_args(argv)


def test_module_lookup_imports_nothing():
    """``run -m`` finds the module as python -m would, without running it."""
    assert target_problem("tests.cli.crash_train", module=True) is None
    assert target_problem("json.tool", module=True) is None
    assert "no module named" in target_problem("tests.cli.no_such_h6", module=True)


def test_unreachable_endpoint_ends_within_the_timeout_naming_it(capsys, monkeypatch):
    monkeypatch.setenv("SHARDWISE_TIMEOUT", "1")
    with closed_port() as port:  # nothing listens there (tests/harness/ports.py)
        endpoint = f"127.0.0.1:{port}"
        line = _error_line(capsys, ["run", "--nnodes", "2", "--node-rank", "1",
                                    "--rdzv-endpoint", endpoint, "x.py"])
    assert f"--rdzv-endpoint {endpoint}: nothing answered there within 1 s" in line


@pytest.mark.parametrize("argv", [
    ["run", "--nproc", "2", "/nonexistent/script.py"],
    ["run", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "ENDPOINT",
     "x.py"],
], ids=lambda a: " ".join(a[:4]))
def test_the_launching_program_prints_one_line(tmp_path, argv):
    """As a real program: one line from the launcher, none from any rank."""
    from tests.harness import procs

    env = dict(os.environ, SHARDWISE_TIMEOUT="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(procs.ROOT), str(procs.ROOT / "src")]))
    with closed_port() as port:  # nothing listens there (tests/harness/ports.py)
        argv = [a.replace("ENDPOINT", f"127.0.0.1:{port}") for a in argv]
        done = procs.run(["-m", "shardwise", *argv], env, tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise {argv[0]}: error: "), done.stderr
    assert done.stdout == ""
