"""Help that costs nothing: ``shardwise --help`` and every subcommand's ``--help`` parse and
print without importing torch, and the package's public names resolve lazily.

Each check runs in a fresh interpreter (``subprocess``: what matters is what a real process
imports, not what a forked test process already holds).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import pytest

from shardwise.cli.main import _parser, main
from shardwise.cli.train_args import TrainConfig
from tests.harness import procs

SUBCOMMANDS = [[], ["train"], ["run"], ["plan"], ["plot"], ["checkpoint"],
               ["checkpoint", "export"], ["checkpoint", "inspect"], ["bench"]]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(procs.ROOT), str(procs.ROOT / "src")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=procs.ROOT)


def test_every_help_leaves_torch_unimported():
    done = _python(f"""
        import contextlib, io, sys
        from shardwise.cli.main import main
        for argv in {SUBCOMMANDS!r}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    main([*argv, "--help"])
                except SystemExit as exc:
                    assert exc.code in (0, None), (argv, exc.code)
            assert "usage" in out.getvalue().lower(), (argv, out.getvalue())
            assert "torch" not in sys.modules, f"shardwise {{' '.join(argv)}} --help imports torch"
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_public_names_resolve_on_first_use_and_dir_lists_them():
    done = _python("""
        import sys, warnings
        import shardwise
        assert "torch" not in sys.modules
        assert set(shardwise.__all__) <= set(dir(shardwise)) and shardwise.__version__
        from shardwise import fully_shard, DistributedDataParallel
        import shardwise.distributed.init  # the submodule does not replace the function
        from shardwise.distributed import init
        from shardwise.fsdp import fully_shard as defined
        assert fully_shard is defined and shardwise.fully_shard is defined
        assert shardwise.rpc is sys.modules["shardwise.rpc"]
        assert callable(init) and shardwise.distributed.init is init
        assert shardwise.ZeroRedundancyOptimizer.__name__ == "ZeroRedundancyOptimizer"
        try:
            shardwise.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("an unknown name resolved")
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_torch_version_check_runs_once_on_first_use():
    done = _python("""
        import warnings
        import shardwise, shardwise._compat as compat
        compat.in_tested_range = lambda version: False  # as under an untested torch
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            shardwise.DistributedDataParallel, shardwise.fully_shard, shardwise.rpc
        print(len([w for w in seen if "is tested with torch" in str(w.message)]))
    """)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


@pytest.mark.parametrize("package", ["shardwise.distributed", "shardwise.launch",
                                     "shardwise.memory", "shardwise.models"])
def test_a_subpackage_lists_and_resolves_its_names(package):
    done = _python(f"""
        import importlib
        pkg = importlib.import_module({package!r})
        names = getattr(pkg, "__all__", None) or [n for n in dir(pkg) if not n.startswith("_")]
        for name in names:
            assert name in dir(pkg) and getattr(pkg, name) is not None, name
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{prefix} {name}".strip())
    yield prefix, parser


def _documented_defaults():
    for name, parser in _subparsers(_parser()):
        if name in ("", "bench", "checkpoint"):  # bench parses its own flags
            continue
        for action in parser._actions:
            default = action.default
            if (action.option_strings and default not in (None, argparse.SUPPRESS, (), [])
                    and not isinstance(default, bool)):
                yield name, action


@pytest.mark.parametrize("name,action", list(_documented_defaults()),
                         ids=lambda x: x if isinstance(x, str) else x.option_strings[-1])
def test_every_flag_shows_its_default_and_choices(name, action):
    parser = dict(_subparsers(_parser()))[name]
    entries = re.split(r"\n(?=  -)", parser.format_help().partition("options:")[2])
    entry = " ".join(next(e for e in entries
                          if action.option_strings[0] in e.split()[0:2]).split())
    default = action.default
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    assert entry.endswith(f"(default: {shown})"), (name, entry)
    if action.choices:
        assert "{" + ",".join(map(str, action.choices)) + "}" in entry, (name, entry)


def test_train_defaults_are_train_configs():
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    train = dict(_subparsers(_parser()))["train"]
    checked = [a.dest for a in train._actions if a.dest in fields]
    for dest in checked:
        action = next(a for a in train._actions if a.dest == dest)
        assert action.default == fields[dest], dest
    assert {"steps", "batch_size", "lr", "strategy", "replicas", "tp"} <= set(checked)


@pytest.mark.parametrize("argv,meant", [
    (["train", "--step", "2"], "--steps"), (["train", "--batch", "4"], "--batch-size"),
    (["plan", "--simul"], "--simulate"), (["run", "--npro", "2", "x.py"], "--nproc"),
    (["plot", "--ou", "x.png", "d"], "--out"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else a)
def test_a_prefix_of_a_long_flag_is_refused_naming_the_flag(capsys, monkeypatch, argv, meant):
    def never(*args, **kwargs):
        raise AssertionError("a prefix of a flag was taken for the flag")

    monkeypatch.setattr("shardwise.cli.launch_args.launch", never)
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"shardwise {argv[0]}: error: unrecognized arguments: {argv[1]}")
    assert f"did you mean {meant}?" in err
