"""Help that costs nothing: ``shardwise --help`` and every subcommand's ``--help`` parse and
print without importing torch, and the package's public names resolve lazily.

Each check runs in a fresh interpreter (``subprocess``: what matters is what a real process
imports, not what a forked test process already holds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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
