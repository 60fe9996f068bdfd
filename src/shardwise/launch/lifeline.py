"""A rank dies with its launcher, even when the launcher is killed with SIGKILL.

Two mechanisms, because neither alone is enough:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to kill this process when its
  parent dies (checked right after, since the parent may already be gone);
* everywhere, the launcher keeps the write end of a pipe whose read end every rank inherits
  (``SHARDWISE_LAUNCHER_FD``); a watcher thread blocks reading it, and end-of-file means the
  launcher is gone: the rank says so on stderr and exits at once (the launcher can no longer
  stop it, nor report anything it does).

Both are armed before the rank imports anything heavy: rank_boot.py loads this file and the
environment's readers (distributed/env.py, through ``boot_env``; both standard library only) by
their paths, forks the rank's guard (descendants.py), calls ``install``, and only then imports
shardwise and torch. ``install`` notes in the environment that this process is armed
(``SHARDWISE_LIFELINE_ARMED``, its pid), so a second call (bootstrap.py's, for ranks started
without rank_boot.py) does nothing.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading

LAUNCHER_PID_VAR = "SHARDWISE_LAUNCHER_PID"
LAUNCHER_FD_VAR = "SHARDWISE_LAUNCHER_FD"
PR_SET_PDEATHSIG = 1
EXIT_LAUNCHER_GONE = 128 + signal.SIGHUP
ARMED_VAR = "SHARDWISE_LIFELINE_ARMED"
_BOOT_ENV = "_shardwise_boot_env"  # env.py loaded by its path (see boot_env)
_BOOT_LIBC = "_shardwise_boot_libc"  # distributed/host/libc.py, likewise


def install() -> None:
    """Tie this process's life to the launcher named in the environment (no-op without one,
    and when this process is armed already)."""
    env = boot_env()
    if env.str_var(ARMED_VAR) == str(os.getpid()):
        return
    pid = env.int_var(LAUNCHER_PID_VAR, default=0, minimum=0)
    fd = env.int_var(LAUNCHER_FD_VAR, default=-1, minimum=-1)
    os.environ[ARMED_VAR] = str(os.getpid())
    if pid:
        _die_with_parent(pid)
    if fd >= 0:
        threading.Thread(target=_watch_pipe, args=(fd,), daemon=True,
                         name="shardwise-lifeline").start()


def boot_env():
    """The environment's readers (distributed/env.py) without importing shardwise's package,
    which imports torch: the package's module once it is imported, else env.py (standard library
    only) loaded by its path under a private name, as rank_boot.py loads this file."""
    return _by_path("shardwise.distributed.env", _BOOT_ENV, "env.py")


def _by_path(name: str, private: str, *parts: str):
    """Module ``name`` once imported, else its file under distributed/ loaded as ``private``."""
    module = sys.modules.get(name) or sys.modules.get(private)
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                            "distributed", *parts)
        spec = importlib.util.spec_from_file_location(private, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module
        spec.loader.exec_module(module)
    return module


def _die_with_parent(launcher_pid: int) -> None:
    libc = _by_path("shardwise.distributed.host.libc", _BOOT_LIBC, "host", "libc.py")
    libc.die_with_parent(signal.SIGKILL)  # prctl(PR_SET_PDEATHSIG) on Linux
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        _launcher_gone()


def _watch_pipe(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    _launcher_gone()


def _launcher_gone() -> None:
    rank = boot_env().str_var("RANK", "?")
    try:
        os.write(2, f"shardwise: rank {rank}: the launcher is gone; exiting\n".encode())
    finally:
        os._exit(EXIT_LAUNCHER_GONE)
