"""The one way tests start processes: the standard library's forkserver, or fresh interpreters.

[Note: test processes]
A new Python process on two cores spends seconds importing torch. Every process a test starts
(the ranks of a pool, the ranks of the vendored ZeRO tests, the RPC workers, a program run as
``python -m MODULE`` / ``python SCRIPT`` / ``python -c CODE``) comes from ``context()``:
multiprocessing's own forkserver context, whose server imports ``PRELOAD`` once and forks a
new process per request. The server runs no thread of its own (it is started with
``OMP_NUM_THREADS=1``: with more, importing torch starts one), so forking it is safe.

With ``--fresh`` (``SHARDWISE_TEST_FRESH=1``), or where the forkserver method does not exist,
``context()`` is the spawn context instead: every process a fresh interpreter that imports
what it needs itself. CI runs the tests marked ``fresh`` that way (docs/testing.md).

A program (``start``/``run``) is a non-daemonic ``Process`` that takes the program's
environment, working directory, argv and ``sys.path`` (its PYTHONPATH first), writes stdout and
stderr to files or pipes, runs the module, script or code as ``__main__``, and runs the exit
handlers the program registered with ``atexit`` before it exits; ``Program`` gives it the part
of ``subprocess.Popen``'s interface the tests use.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
import weakref
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FRESH_ENV = "SHARDWISE_TEST_FRESH"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.rpc", "torch.distributed.autograd",
           "torch.distributed.optim", "torch.distributed.nn", "torch.nn.parallel",
           "torch.distributed.tensor", "torch.optim",
           "torch._dynamo",  # what an optimizer's first construction imports
           "torch.testing._internal.common_distributed",  # the vendored ZeRO tests' ranks
           # shardwise's package names its API lazily: the mechanisms, imported here
           "shardwise", "shardwise.ddp", "shardwise.zero", "shardwise.fsdp", "shardwise.rpc",
           "shardwise.sharded_tensor", "shardwise.distributed.init", "shardwise.distributed.mesh",
           "shardwise.distributed.comm_counter", "tests.harness.pool")
_server_started = False


def fresh() -> bool:
    """Whether processes are fresh interpreters (``--fresh``, or no forkserver here)."""
    return (os.environ.get(FRESH_ENV) == "1"
            or "forkserver" not in mp.get_all_start_methods())


def context() -> mp.context.BaseContext:
    """The multiprocessing context every test process starts from (see [Note: test processes]).
    The forkserver starts on first use, with ``PRELOAD`` imported and OMP_NUM_THREADS=1."""
    global _server_started
    if fresh():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _server_started:
        ctx.set_forkserver_preload(list(PRELOAD))
        outer = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment, taken at its start
        try:
            forkserver.ensure_running()
        finally:
            if outer is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = outer
        _server_started = True
    return ctx


# ---------------------------------------------------------------- programs
class Program:
    """A started program or forked call, with ``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``send_signal`` and ``kill``. ``stdout`` and ``stderr``
    are streams to read while it runs where it was started with ``streams=True``, else None and
    its output comes from ``communicate`` (read from its files)."""

    def __init__(self, proc, args: list[str], files: tuple = (None, None), streams=(None, None)):
        self._proc, self.args, self._files = proc, args, files
        self.stdout, self.stderr = streams
        self.pid = proc.pid
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        if self._code is None and self._proc.exitcode is not None:
            self._code = self._proc.exitcode
            self._proc.close()  # its sentinel's file descriptor, now rather than at collection
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:
            self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._code

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """(stdout, stderr), or (both together, None) where stderr went with stdout."""
        if self.stdout is None:
            self.wait(timeout)
            return tuple(None if f is None else Path(f).read_text(errors="replace")
                         for f in self._files)
        texts: dict = {}
        readers = [threading.Thread(target=lambda s=s: texts.__setitem__(s, s.read()),
                                    daemon=True) for s in (self.stdout, self.stderr) if s]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for stream in (self.stdout, self.stderr):
            if stream:
                stream.close()
        return texts[self.stdout], texts.get(self.stderr)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_logs: Path | None = None
_ids = itertools.count()
_programs: weakref.WeakSet[Program] = weakref.WeakSet()  # (for _stop_programs)


def _log_path(name: str) -> str:
    global _logs
    if _logs is None:
        _logs = Path(tempfile.mkdtemp(prefix="shardwise-programs-"))
        atexit.register(shutil.rmtree, _logs, True)
    return str(_logs / name)


def start(cmd: list[str], env: dict, cwd: str | Path | None = None, merge_stderr: bool = True,
          streams: bool = False) -> Program:
    """Start ``python *cmd`` (``["-m", module, *args]``, ``["-c", code, *args]`` or
    ``[script, *args]``) with the environment ``env`` in ``cwd`` (default: this process's), as
    a process from ``context()``. Its stderr goes with its stdout, or apart
    (``merge_stderr=False``); with ``streams=True`` both are pipes read while it runs (as with
    ``stdout=PIPE, stderr=PIPE, text=True``), else files read by ``communicate``."""
    cmd, rid = list(cmd), next(_ids)
    files = (_log_path(f"{rid}.out"), None if merge_stderr else _log_path(f"{rid}.err"))
    pipes = [mp.Pipe(duplex=False) if streams and (i == 0 or not merge_stderr) else None
             for i in range(2)]
    outs = [p[1] if p else f for p, f in zip(pipes, files)]
    proc = context().Process(target=_program_main,
                             args=(cmd, dict(env), str(cwd or os.getcwd()), outs),
                             name=f"shardwise-test-program{rid}")
    proc.start()
    readers = []
    for pipe in pipes:
        if pipe is None:
            readers.append(None)
            continue
        pipe[1].close()  # the program holds the write end
        readers.append(open(os.dup(pipe[0].fileno()), errors="replace"))  # noqa: SIM115
        pipe[0].close()
    program = Program(proc, cmd, files if not streams else (None, None), tuple(readers))
    _programs.add(program)
    return program


def run(cmd: list[str], env: dict, cwd: str | Path | None = None, timeout: float | None = None
        ) -> subprocess.CompletedProcess:
    """As ``subprocess.run([sys.executable, *cmd], capture_output=True, text=True, ...)``, the
    program started by :func:`start`; killed if it runs past ``timeout``."""
    program = start(cmd, env, cwd, merge_stderr=False)
    try:
        stdout, stderr = program.communicate(timeout)
    finally:
        program.kill()
    return subprocess.CompletedProcess(program.args, program.returncode, stdout, stderr)


def outputs(programs: list[Program], timeout: float) -> list[tuple[int, str]]:
    """Each program's (exit status, output), in order, waiting up to ``timeout`` for each; when
    one runs past it, every program is killed and ``TimeoutExpired`` raised."""
    out = []
    for program in programs:
        try:
            text, _ = program.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in programs:
                other.kill()
            raise
        out.append((program.returncode, text))
    return out


def _redirect(fd: int, out) -> None:
    if isinstance(out, str):
        target = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    else:  # the write end of a pipe (a Connection)
        os.dup2(out.fileno(), fd)
        out.close()


def _program_main(cmd: list[str], env: dict, cwd: str, outs: list) -> None:
    """In the new process: become ``python *cmd`` with ``env`` in ``cwd``."""
    _redirect(1, outs[0])
    if outs[1] is None:
        os.dup2(1, 2)
    else:
        _redirect(2, outs[1])
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS"):
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    handlers: list[tuple] = []
    real_register = atexit.register
    atexit.register = _recording(handlers)
    try:
        _run_as_main(cmd, pythonpath)
    finally:
        atexit.register = real_register
        for fn, args, kwargs in reversed(handlers):  # as the interpreter's exit would
            with contextlib.suppress(Exception):
                fn(*args, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()


def _recording(handlers: list) -> Callable:
    """An ``atexit.register`` that records what the program registers, for _program_main to
    run in reverse order when the program ends (the process ends without the interpreter's
    own exit, as every multiprocessing process does)."""

    def register(fn, *args, **kwargs):
        handlers.append((fn, args, kwargs))
        return fn
    return register


def _site_path() -> list[str]:
    """This interpreter's own sys.path entries: not the test root, not a PYTHONPATH entry."""
    ours = {str(ROOT), "", "."} | set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    return [p for p in sys.path if p not in ours]


def _run_as_main(cmd: list[str], pythonpath: list[str]) -> None:
    path = pythonpath + _site_path()
    if cmd[0] == "-m":
        sys.path[:] = [os.getcwd(), *path]
        sys.argv = [cmd[1], *cmd[2:]]
        runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    elif cmd[0] == "-c":
        sys.path[:] = ["", *path]
        sys.argv = ["-c", *cmd[2:]]
        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        exec(compile(cmd[1], "<string>", "exec"), module.__dict__)
    else:
        script = os.path.abspath(cmd[0])
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
        sys.argv = list(cmd)
        runpy.run_path(script, run_name="__main__")


# ---------------------------------------------------------------- a program's own second process
def fork_call(fn: Callable[[], Any], env: dict) -> Program:
    """Run ``fn()`` in a process forked from this program (multiprocessing's fork context),
    with ``env`` added to its environment: the program's second process (a callee, a victim)
    without importing torch again. This process must run no Python thread yet (no RPC agent,
    no process group): forking a threaded process is unsafe."""
    if threading.active_count() != 1:
        raise RuntimeError("fork_call: this process already runs threads")
    sys.stdout.flush()
    sys.stderr.flush()
    proc = mp.get_context("fork").Process(target=_call_with_env, args=(fn, env))
    proc.start()
    return Program(proc, [getattr(fn, "__qualname__", repr(fn))])


def _call_with_env(fn: Callable[[], Any], env: dict) -> None:
    os.environ.update(env)
    fn()


def _stop_programs() -> None:
    """At exit, kill the programs still running (multiprocessing would wait for them)."""
    for program in list(_programs):
        program.kill()
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            program.wait(5)


atexit.register(_stop_programs)


def peer_reads_permitted() -> bool:
    """Whether this host lets the test's ranks (siblings: forked by one server) read each other's
    memory ([Note: reading a peer's memory], distributed/host/peers.py): Linux, and Yama's
    ``ptrace_scope`` 0 or no Yama at all."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True
