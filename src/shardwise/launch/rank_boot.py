"""The first code a rank runs: ``python .../shardwise/launch/rank_boot.py [-m] TARGET ...``.

Run by its path, not with ``-m``, so that nothing of shardwise (whose package imports torch)
is imported before the rank is tied to its launcher. Standard library only. It

1. puts the working directory first on ``sys.path``, as ``python -m`` does (not this file's
   directory);
2. forks the rank's guard, which takes the rank's descendants down if the launcher is killed
   outright (descendants.py, [Note: a rank's descendants]), while this process has one thread;
3. arms the lifeline (lifeline.py: PR_SET_PDEATHSIG and the pipe watch);
4. runs bootstrap.py as ``__main__`` with the same arguments (which imports shardwise, torch and
   the target).

A launcher killed while its ranks still import torch so takes them with it at once.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str):
    """The sibling module ``name``.py, loaded by path under a private name (its package, which
    imports torch, stays unimported)."""
    spec = importlib.util.spec_from_file_location(f"_shardwise_boot_{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
        sys.path[0] = os.getcwd()
    lifeline = _load("lifeline")
    env = lifeline.boot_env()  # distributed/env.py, by its path
    fd = env.str_var(lifeline.LAUNCHER_FD_VAR, "")
    if fd.isdigit():  # forked first, while this process has one thread
        descendants = _load("descendants")
        descendants.start_guard(int(fd), env.str_var(descendants.LAUNCH_ID_VAR))
    lifeline.install()
    runpy.run_module("shardwise.launch.bootstrap", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
