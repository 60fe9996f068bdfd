"""Start test programs (``python -m MODULE``, ``python SCRIPT``, ``python -c CODE``) without
each one importing torch again.

Tests that run small programs as processes of their own (tests/compat's side-by-side RPC runs,
the scenarios of tests/rpc, the crash scripts of tests/checkpoint and tests/cli) pay about 3 s
of CPU per process to import torch, most of what such a test takes on two cores. A zygote
process imports torch's modules once (torch, its RPC, distributed autograd and optimizer,
DTensor: not shardwise, so that a run of torch's RPC holds torch's modules only), then forks one
child per program. The child is a separate process as before: it takes the program's
environment (os.environ; sys.path from its PYTHONPATH), working directory and argv, runs the
module, script or code as ``__main__`` as ``python`` does, writes its output to files, and exits
through the interpreter's own shutdown (threads joined, atexit handlers run); its exit code or
signal is reported like ``subprocess.Popen``'s ``returncode``. What torch read from the
environment while it was imported is the zygote's: programs run with OMP_NUM_THREADS=1.

The zygote itself runs no torch op and starts no thread, so forking it is safe (checked at
start: it refuses to serve with a second thread). A program that starts a second process of its
own (a callee, a victim) forks it with :func:`fork_call` before it starts any thread, for the
same reason.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch.distributed.rpc", "torch.distributed.autograd",
           "torch.distributed.optim", "torch.distributed.nn", "torch.nn.parallel",
           "torch.distributed.tensor", "torch.optim",
           "torch._dynamo")  # what an optimizer's first construction imports (0.5 s)


ROOT = Path(__file__).resolve().parents[2]
_site_path: list[str] = []  # the interpreter's own sys.path (stdlib, site): no PYTHONPATH's


def _pythonpath(env: dict) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# ---------------------------------------------------------------- the zygote process
def serve() -> None:
    """The zygote's main loop (``python -c "from tests.harness.zygote import serve; serve()"``):
    one JSON request per line on stdin; replies ``pid ID PID`` and ``exit PID CODE`` lines."""
    _site_path[:] = sys.path[1:]  # (started without PYTHONPATH, in ROOT)
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("zygote: a thread started while importing; forking would be unsafe")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the replies
    replies.write("ready\n")
    pending, children = b"", set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.02 if children else None)
        _reap(children, replies)
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:  # the test process is gone: so are its programs
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            replies.flush()
            sys.stderr.flush()
            # opened here, so that the test process, reading from a FIFO, sees a writer at once
            outs = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    for path in (request["log"], request.get("err") or request["log"])]
            pid = os.fork()
            if pid == 0:
                replies.close()
                _become(request, outs)  # never returns: the program ends the process
            for fd in outs:
                os.close(fd)
            children.add(pid)
            replies.write(f"pid {request['id']} {pid}\n")


def _reap(children: set, replies) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        replies.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")


def _become(request: dict, outs: list[int]) -> None:
    """In the forked child: become ``python *cmd`` with the request's environment and cwd,
    writing to ``outs`` (stdout, stderr)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(outs[0], 1)
    os.dup2(outs[1], 2)
    for fd in (null, *outs):
        os.close(fd)
    # unbuffered, as the programs' stdout was (PYTHONUNBUFFERED or a line at a time)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cmd = request["cmd"]
    path = _pythonpath(os.environ) + _site_path
    if cmd[0] == "-m":
        sys.path[:] = [os.getcwd(), *path]
        sys.argv = ["-m", *cmd[2:]]
        runpy._run_module_as_main(cmd[1], alter_argv=True)
    elif cmd[0] == "-c":
        sys.path[:] = ["", *path]
        sys.argv = ["-c", *cmd[2:]]
        _run_as_main(compile(cmd[1], "<string>", "exec"), None)
    else:
        script = os.path.abspath(cmd[0])
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
        sys.argv = list(cmd)
        _run_as_main(compile(Path(script).read_text(), script, "exec"), script)
    sys.exit(0)


def _run_as_main(code, file: str | None) -> None:
    namespace = sys.modules["__main__"].__dict__
    namespace.pop("serve", None)  # the zygote's own name there
    namespace.update(__name__="__main__", __package__=None, __spec__=None, __cached__=None)
    if file is not None:
        namespace["__file__"] = file
    exec(code, namespace)


# ---------------------------------------------------------------- the test process's side
class Program:
    """A started program, with the part of ``subprocess.Popen``'s interface the tests use:
    ``stdout`` and ``stderr`` are streams to read while it runs where it was started with
    ``streams=True`` (as with ``stdout=PIPE, stderr=PIPE, text=True``), else None and its
    output comes from ``communicate``."""

    def __init__(self, zygote: Zygote, pid: int, log: Path, err: Path | None, args: list[str],
                 streams: tuple | None):
        self._zygote, self.pid, self.log, self.err, self.args = zygote, pid, log, err, args
        self.returncode: int | None = None
        self.stdout, self.stderr = streams or (None, None)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.pump(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._zygote.pump(left)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """(stdout, stderr), or (stdout and stderr together, None) as with
        ``stderr=subprocess.STDOUT``: what is left to read of them, with streams."""
        if self.stdout is None:
            self.wait(timeout)
            return self.log.read_text(errors="replace"), (
                None if self.err is None else self.err.read_text(errors="replace"))
        deadline = None if timeout is None else time.monotonic() + timeout
        texts: dict = {}
        readers = [threading.Thread(target=lambda s=s: texts.__setitem__(s, s.read()),
                                    daemon=True) for s in (self.stdout, self.stderr) if s]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream:
                stream.close()
        return texts[self.stdout], texts.get(self.stderr)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, env: dict):
        self.logs = Path(tempfile.mkdtemp(prefix="shardwise-zygote-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.harness.zygote import serve; serve()"], cwd=ROOT,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.started: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # pid -> exit code, not yet claimed by a Program
        self.programs: dict[int, Program] = {}
        self.buffer = b""
        if self.proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the zygote did not start (exit code {self.proc.wait()})")

    def start(self, cmd: list[str], env: dict, cwd: str, merge_stderr: bool, streams: bool
              ) -> Program:
        with self.lock:
            rid = next(self.ids)
            log, err = self.logs / f"{rid}.out", None if merge_stderr else self.logs / f"{rid}.err"
            readers = tuple(_fifo_reader(p) if p else None for p in (log, err)) if streams \
                else None
            request = {"id": rid, "cmd": cmd, "env": env, "cwd": cwd, "log": str(log),
                       "err": err and str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            while rid not in self.started:
                self._read_line(None)
            pid = self.started.pop(rid)
            program = self.programs[pid] = Program(self, pid, log, err, cmd, readers)
            if pid in self.exits:
                program.returncode = self.exits.pop(pid)
            return program

    def pump(self, timeout: float | None) -> None:
        """Read the zygote's replies that arrive within ``timeout`` seconds (one at least, if
        any comes)."""
        with self.lock:
            self._read_line(timeout)

    def _read_line(self, timeout: float | None) -> None:
        if b"\n" not in self.buffer:
            fd = self.proc.stdout.fileno()
            poller = select.poll()  # (not select(): the test process may hold 1,024 fds)
            poller.register(fd, select.POLLIN)
            if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
                return
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"the zygote died (exit code {self.proc.wait()})")
            self.buffer += data
            if b"\n" not in self.buffer:
                return
        line, self.buffer = self.buffer.split(b"\n", 1)
        kind, a, b = line.decode().split()
        if kind == "pid":
            self.started[int(a)] = int(b)
        elif int(a) in self.programs:
            self.programs.pop(int(a)).returncode = int(b)
        else:
            self.exits[int(a)] = int(b)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.logs, ignore_errors=True)  # the programs' output files


def _fifo_reader(path: Path):
    """A text stream reading from a new FIFO at ``path`` (the zygote opens its write end before
    it forks the program, so that reading never sees an end-of-file before the program's)."""
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a blocking open waits for a writer)
    os.set_blocking(fd, True)
    return open(fd, errors="replace")  # noqa: SIM115


_zygote: Zygote | None = None


def start(cmd: list[str], env: dict, cwd: str | Path | None = None, merge_stderr: bool = True,
          streams: bool = False) -> Program:
    """Start ``python *cmd`` (``["-m", module, *args]``, ``["-c", code, *args]`` or
    ``[script, *args]``) with the environment ``env`` in ``cwd`` (default: this process's),
    forked from the session's zygote. Its stderr goes with its stdout, or apart
    (``merge_stderr=False``); with ``streams=True``, ``Program.stdout`` and ``.stderr`` are
    read while it runs (see Program). The zygote starts on first use, with the first caller's
    ``env`` less PYTHONPATH (each program's own builds its sys.path): what torch reads while it
    is imported must be the same for every program, and OMP_NUM_THREADS=1 (with more,
    importing torch starts a thread)."""
    global _zygote
    if env.get("OMP_NUM_THREADS") != "1":
        raise ValueError("programs forked from the zygote run with OMP_NUM_THREADS=1")
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = Zygote({k: v for k, v in env.items() if k != "PYTHONPATH"})
        atexit.register(_zygote.close)
    return _zygote.start(list(cmd), dict(env), str(cwd or os.getcwd()), merge_stderr, streams)


def run(cmd: list[str], env: dict, cwd: str | Path | None = None, timeout: float | None = None
        ) -> subprocess.CompletedProcess:
    """As ``subprocess.run([sys.executable, *cmd], capture_output=True, text=True, ...)``, the
    program forked from the zygote (see :func:`start`); killed if it runs past ``timeout``."""
    program = start(cmd, env, cwd, merge_stderr=False)
    try:
        stdout, stderr = program.communicate(timeout)
    finally:
        program.kill()
    return subprocess.CompletedProcess(program.args, program.returncode, stdout, stderr)


# ---------------------------------------------------------------- a program's own second process
class Forked:
    """A child forked by a program, with ``wait`` and ``returncode`` as ``subprocess.Popen``'s
    (see :func:`fork_call`)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode


def fork_call(fn, env: dict) -> Forked:
    """Run ``fn()`` in a forked child of this program, with ``env`` added to its environment,
    in place of starting the same module again with ``subprocess.Popen`` (which imports torch
    again): the child has the program's modules, stdout and stderr, and ends through the
    interpreter's shutdown (a SystemExit that unwinds the caller's frames, so call this where
    no ``finally`` or ``except`` of the caller encloses it). This process must run no Python
    thread yet (no RPC agent, no process group)."""
    if threading.active_count() != 1:
        raise RuntimeError("fork_call: this process already runs threads")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.environ.update(env)
        fn()
        sys.exit(0)
    return Forked(pid)
