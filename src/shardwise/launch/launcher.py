"""The launcher: N ranks of one command per node, no cluster manager needed.

The launcher owns its ranks (see docs/launcher.md for the whole design):

* it hosts the rendezvous TCPStore (node 0 of a multi-node job hosts it at ``--rdzv-endpoint``)
  and tells the ranks so through ``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent does;
  scripts that call ``torch.distributed.init_process_group`` themselves work unchanged;
* each rank's output is relayed with ``[rankN]:`` in front;
* on SIGTERM, SIGHUP or SIGINT it forwards SIGTERM to every rank, waits ``grace_seconds``, kills
  what is left and exits 128+signal; if the launcher itself is killed, its ranks notice within a
  second and exit (lifeline.py);
* when a rank fails it stops the others and reports the root cause (the earliest failure that is
  not a consequence of another, [Note: blame] in errors.py), or, with ``max_restarts``, restarts
  the whole group with a fresh rendezvous (``TORCHELASTIC_RESTART_COUNT`` counts the restarts);
* its watchdog (watchdog.py) stops and names ranks that stop making progress, and ranks left
  hanging after the others exited 0, with a stack dump of where they were.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from shardwise.distributed import signed_store
from shardwise.distributed.env import (
    AGENT_STORE_VAR,
    RPC_SECRET_FILE_VAR,
    RPC_SECRET_VAR,
    child_environment,
)
from shardwise.distributed.private_files import host_identity
from shardwise.distributed.timeouts import as_timedelta
from shardwise.launch import descendants, job_secret, rank_boot
from shardwise.launch.blame import Blame, RankExit, blame
from shardwise.launch.errors import ERROR_FILE_VAR, read_record
from shardwise.launch.lifeline import LAUNCHER_FD_VAR, LAUNCHER_PID_VAR
from shardwise.launch.nodes import Layout, NodeError, NodeLink, open_store
from shardwise.launch.output import PrefixedRelay, Screen, lines_since, stack_dump
from shardwise.launch.preemption import DEFAULT_GRACE_SECONDS, GRACE_VAR
from shardwise.launch.progress import ATTEMPT_VAR, PIPE_VAR, SCOPE, ProgressPipe
from shardwise.launch.watchdog import Hang, Watchdog

LOCALHOST = "127.0.0.1"
SETTLE_SECONDS = 2.0  # after a first failure: time for the other ranks' records to arrive
POLL_SECONDS = 0.2
_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_STORE_ERRORS = (RuntimeError, dist.DistError, OSError)
_SECRET_FILE = "shardwise/secret/file_id"  # node 0's secret file, for launchers on its host
_SECRET_HOST = "shardwise/secret/host"  # node 0's host
_SECRET_CHECK = "shardwise/secret/check"  # signed by node 0: the others check their secret


def python_command(target: str, args: Sequence[str] = (), module: bool = False) -> list[str]:
    """The command that runs a Python script (or ``-m`` module) as a rank the launcher owns:
    through rank_boot.py (the lifeline and the guard, armed before anything heavy is imported)
    and bootstrap.py (the failure record and the progress records)."""
    head = ["-m", target] if module else [target]
    return [sys.executable, str(Path(rank_boot.__file__).resolve()), *head, *args]


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    max_restarts: int = 0,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    timeout: float | None = None,
) -> int:
    """Run ``argv`` as ``nproc`` ranks on this node and return the job's exit status.

    0 when every rank of every node succeeded; the failed rank's status (or 1) otherwise;
    128+signal when the launcher was told to stop. ``timeout`` (default ``$SHARDWISE_TIMEOUT``)
    bounds the rendezvous of nodes and the watchdog's patience. Raises ``NodeError`` when the
    launchers of a multi-node job do not agree.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if not argv:
        raise ValueError("launch needs a command to run")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be at least 0, got {max_restarts}")
    if not (math.isfinite(grace_seconds) and grace_seconds > 0):
        raise ValueError(f"grace_seconds must be positive and finite, got {grace_seconds}")
    if nnodes < 1:
        raise NodeError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise NodeError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, "
                        f"got {node_rank}")
    if nnodes > 1 and rdzv_endpoint is None:
        raise NodeError("--nnodes above 1 needs --rdzv-endpoint host:port (node 0's address)")
    seconds = as_timedelta(timeout).total_seconds()
    job = _Job(list(argv), child_environment() if env is None else dict(env), stdout or sys.stdout,
               stderr or sys.stderr, max_restarts, grace_seconds, seconds)
    job.nproc, job.node_rank, job.nnodes = nproc, node_rank, nnodes
    try:
        if rdzv_endpoint is None:
            job.store = dist.TCPStore(LOCALHOST, 0, None, is_master=True,
                                      wait_for_workers=False)
            job.host, job.layout = LOCALHOST, Layout(0, nproc)
            job.use_secret(_given_secret(job.base_env) or job_secret.fresh())
        else:
            job.endpoint = rdzv_endpoint
            job.host = rdzv_endpoint.rpartition(":")[0].strip("[]")
            job.first_attempt = job.connect(0)
        if nnodes == 1:  # one host: the ranks' RPC secret, private to them (rpc/trust/secret.py)
            job.base_env.setdefault(RPC_SECRET_VAR, secrets.token_hex(32))
        with _SignalTrap() as trap:
            job.trap = trap
            return job.run()
    finally:
        if job.link is not None:
            job.link.close()
        if job.secret_file is not None:
            job.secret_file.unlink(missing_ok=True)


def _given_secret(environ: Mapping[str, str]) -> bytes | None:
    try:
        return job_secret.from_environment(environ)
    except job_secret.SecretFileError as exc:
        raise NodeError(str(exc)) from exc


@dataclass
class _Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    relays: list[PrefixedRelay]
    merged: deque[str]
    error_file: Path
    exit_time: float | None = None
    stopped: bool = False
    stack: str = ""
    published: bool = False  # it wrote a progress record (it runs bootstrap.py)
    progress: ProgressPipe | None = None  # its records, as it wrote them ([Note: progress records])

    def alive(self) -> bool:
        return self.proc.poll() is None


class _SignalTrap:
    """Notes the first SIGTERM/SIGHUP/SIGINT (main thread only); the loop acts on it."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> _SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class _Job:
    argv: list[str]
    base_env: dict[str, str]
    stdout: TextIO
    stderr: TextIO
    max_restarts: int
    grace: float
    timeout: float
    store: dist.Store | None = None
    host: str = LOCALHOST
    layout: Layout = field(default_factory=lambda: Layout(0, 1))
    link: NodeLink | None = None
    nproc: int = 1
    node_rank: int = 0
    nnodes: int = 1
    trap: _SignalTrap | None = None
    lock: Screen = field(default_factory=Screen)  # every write to the terminal
    endpoint: str | None = None  # --rdzv-endpoint (several nodes)
    first_attempt: int = 0  # later than 0 when this launcher replaces a lost node's
    lost_nodes: list[int] = field(default_factory=list)  # nodes whose launcher went silent
    store_lost: bool = False  # node 0, and the store with it, is gone
    job_stopped: bool = False  # a launcher of the job was told to stop: no restart
    launch_id: str = field(default_factory=lambda: secrets.token_hex(16))  # marks descendants
    secret: bytes = b""  # signs the records in the store ([Note: launcher records])
    secret_file: Path | None = None  # node 0 wrote the secret for launchers on its host
    attempt_id: str = ""  # the running attempt's identity, hex (agreed by the nodes)

    def use_secret(self, secret: bytes) -> None:
        self.secret = secret
        self.base_env[job_secret.LAUNCH_SECRET_VAR] = secret.hex()

    def connect(self, attempt: int) -> int:
        """Reach (node 0: host) the rendezvous store and join the other nodes; the attempt to
        run first."""
        if self.link is not None:
            self.link.close()
        self.store = open_store(self.endpoint, self.node_rank, self.nnodes, self.timeout)
        self.use_secret(self._agree_secret())
        self.link = NodeLink(self.store, self.node_rank, self.nnodes, self.nproc,
                             self.max_restarts, self.timeout, self.secret, host=self.host)
        self.layout, first = self.link.join(attempt)
        return first

    def _agree_secret(self) -> bytes:
        """The job's secret, the same on every node (the rule is in job_secret.py); node 0
        signs a check record with it, which the others must open."""
        given = _given_secret(self.base_env)
        if self.node_rank == 0:
            secret = given or job_secret.fresh()
            if given is None:
                if self.secret_file is not None:
                    self.secret_file.unlink(missing_ok=True)
                file_id, self.secret_file = job_secret.write_shared(secret)
                self.store.set(_SECRET_FILE, file_id)
            self.store.set(_SECRET_HOST, host_identity())
            signed_store.put(self.store, _SECRET_CHECK, "node 0", secret, SCOPE)
            return secret
        try:
            self.store.wait([_SECRET_CHECK], timedelta(seconds=self.timeout))
        except _STORE_ERRORS as exc:
            raise NodeError(f"node {self.node_rank}: node 0's launcher did not publish its "
                            f"record within {self.timeout:g} s ({exc})") from exc
        secret = given or self._shared_secret()
        try:
            signed_store.open_record(_SECRET_CHECK, self.store.get(_SECRET_CHECK), secret,
                                     SCOPE)
        except signed_store.BadRecord as exc:
            raise NodeError(f"node {self.node_rank}'s secret is not node 0's: give every "
                            f"launcher the same ${RPC_SECRET_VAR} (or "
                            f"${RPC_SECRET_FILE_VAR})") from exc
        return secret

    def _shared_secret(self) -> bytes:
        """The secret node 0 drew, read from its file: only on node 0's host."""
        if not self.store.check([_SECRET_FILE]):
            raise NodeError(f"node 0 was given a secret and node {self.node_rank} was not: set "
                            f"the same ${RPC_SECRET_VAR} (or ${RPC_SECRET_FILE_VAR}) for every "
                            "launcher")
        if self.store.get(_SECRET_HOST).decode(errors="replace") != host_identity():
            raise NodeError(f"node {self.node_rank} is on another host than node 0 and no job "
                            f"secret is set: set ${RPC_SECRET_VAR} (the same value on every node, "
                            "e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)"
                            f" or ${RPC_SECRET_FILE_VAR} (a file of mode 0600) for every launcher")
        try:
            return job_secret.read_shared(self.store.get(_SECRET_FILE).decode(errors="replace"))
        except job_secret.SecretFileError as exc:
            raise NodeError(f"node {self.node_rank}: {exc}") from exc

    def run(self) -> int:
        workdir = Path(tempfile.mkdtemp(prefix="shardwise-launch-"))
        read_end, self._lifeline = os.pipe()
        os.set_inheritable(read_end, True)
        self._read_end = read_end
        attempt = self.first_attempt
        try:
            while True:
                code, final = self._attempt(attempt, workdir / f"attempt_{attempt}")
                if code == 0 or final or self.job_stopped or attempt >= self.max_restarts:
                    return code
                try:
                    attempt = self._next_attempt(attempt)
                except (NodeError, *_STORE_ERRORS) as exc:
                    self._say(f"shardwise: node {self.node_rank}: cannot restart: {exc}")
                    return code
                self._say(f"shardwise: restarting every rank (restart {attempt} of "
                          f"{self.max_restarts}) with a fresh rendezvous")
        finally:
            os.close(read_end)
            os.close(self._lifeline)
            shutil.rmtree(workdir, ignore_errors=True)

    def _next_attempt(self, attempt: int) -> int:
        """The next attempt's number, after making way for lost nodes to rejoin it."""
        following = attempt + 1
        if self.store_lost:  # node 0's new launcher will host a new store at the endpoint
            self._say(f"shardwise: node {self.node_rank}: waiting up to {self.timeout:g} s for "
                      f"node 0 to be started again")
            self.store_lost = False
            return self.connect(following)
        if self.lost_nodes:
            self.link.mark_lost(self.lost_nodes, following)
            self._say(f"shardwise: node {self.node_rank}: waiting up to {self.timeout:g} s for "
                      f"node(s) {', '.join(map(str, self.lost_nodes))} to be started again")
            self.lost_nodes = []
        return following

    # -- one attempt -------------------------------------------------------------------------

    def _attempt(self, attempt: int, workdir: Path) -> tuple[int, bool]:
        """Run every local rank once; (exit status, whether restarting is ruled out)."""
        if self.link is not None:
            try:
                self.link.wait_ready(attempt)
            except (NodeError, *_STORE_ERRORS) as exc:
                self._say(f"shardwise: node {self.node_rank}: {exc}")
                return 1, True
        # the attempt's identity binds the ranks' records to it (progress.scope_of)
        self.attempt_id = (self.link.attempt_id if self.link is not None
                           else secrets.token_bytes(32)).hex()
        ranks = [self._start(attempt, local, workdir) for local in range(self.nproc)]
        exits: queue.Queue[tuple[int, int, float]] = queue.Queue()
        for i, rank in enumerate(ranks):
            threading.Thread(target=lambda i=i, p=rank.proc: exits.put((i, p.wait(), time.time())),
                             daemon=True, name=f"shardwise-wait-rank{rank.rank}").start()
        watchdog = Watchdog([r.rank for r in ranks], self.timeout)
        try:
            return self._watch(attempt, ranks, exits, watchdog)
        except NodeError as exc:
            self._stop(ranks)
            self._say(f"shardwise: node {self.node_rank}: {exc}; this node's ranks were stopped.")
            return 1, not self.store_lost
        finally:
            self._stop(ranks)
            self._end_descendants(ranks)
            for rank in ranks:
                rank.progress.close()
                for relay in rank.relays:
                    relay.join(timeout=5)

    def _watch(self, attempt, ranks, exits, watchdog) -> tuple[int, bool]:
        next_beat = 0.0
        while True:
            if self.trap is not None and self.trap.received is not None:
                return self._on_signal(ranks, self.trap.received), True
            self._drain(ranks, exits, watchdog, wait=POLL_SECONDS)
            if any(r.proc.returncode not in (None, 0) and not r.stopped or r.error_file.exists()
                   for r in ranks):  # a failure record counts before its rank has exited
                return self._on_failure(attempt, ranks, exits, watchdog), False
            if all(r.proc.returncode == 0 for r in ranks):
                return self._on_success(attempt), False
            now = time.monotonic()
            self._observe(ranks, watchdog, now)
            hang = watchdog.verdict(now)
            if hang is not None:
                return self._on_hang(attempt, ranks, hang), False
            if self.link is not None and now >= next_beat:
                next_beat = now + 0.5
                remote = self._remote_trouble(attempt, now)
                if remote is not None:
                    self._stop(ranks)
                    self._say(remote)
                    return 1, self.job_stopped

    def _drain(self, ranks, exits, watchdog, wait: float) -> None:
        try:
            item = exits.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            index, code, when = item
            ranks[index].exit_time = when
            watchdog.exited(ranks[index].rank, code, time.monotonic())
            try:
                item = exits.get_nowait()
            except queue.Empty:
                return

    def _observe(self, ranks, watchdog, now) -> None:
        """Each live rank's newest record, from its own pipe: what the rank wrote, which no
        other process can delete or write back ([Note: progress records], progress.py)."""
        for rank in ranks:
            if not rank.alive():
                continue
            record = rank.progress.latest()
            rank.published = rank.published or record is not None
            watchdog.observe(rank.rank, record, now)

    def _remote_trouble(self, attempt: int, now: float) -> str | None:
        """Why this node must stop its ranks because of another node, from the node link
        ([Note: node link]): a stop notice, another node's failure, a lost node; else None."""
        try:
            stopped = self.link.stopped()
            remote = self.link.remote_failure(attempt)
            lost = self.link.lost_nodes(now)
        except _STORE_ERRORS as exc:
            return self._lost_node_0(str(exc))
        if stopped:
            self.job_stopped = True
            return f"shardwise: {stopped}; this node's ranks were stopped."
        if remote is not None:
            return (f"shardwise: node {remote[0]} failed; this node's ranks were stopped. "
                    f"Node {remote[0]} reported:\n{remote[1]}")
        if 0 in lost and self.node_rank != 0:
            return self._lost_node_0(f"no word from its launcher for more than "
                                     f"{self.timeout:g} s, or its connection closed")
        if lost:
            self.lost_nodes = lost
            if self.link.never_connected(lost):
                return (f"shardwise: node(s) {', '.join(map(str, lost))} lost: their launcher "
                        f"never connected to this node's within {self.timeout:g} s (no evidence "
                        f"of what became of it; the store may be tampered with); this node's "
                        f"ranks were stopped.")
            return (f"shardwise: node(s) {', '.join(map(str, lost))} lost: no word from their "
                    f"launcher for more than {self.timeout:g} s, or its connection closed; "
                    f"this node's ranks were stopped.")
        return None

    def _lost_node_0(self, why: str) -> str:
        self.store_lost = True
        return (f"shardwise: node {self.node_rank} lost contact with node 0 (the host of the "
                f"rendezvous store) ({why}); this node's ranks were stopped.")

    # -- endings ---------------------------------------------------------------------------

    def _on_signal(self, ranks: list[_Rank], signum: int) -> int:
        name = signal.Signals(signum).name
        self._say(f"shardwise: received {name}; sending SIGTERM to every rank "
                  f"(grace period {self.grace:g} s)")
        if self.link is not None:
            with contextlib.suppress(*_STORE_ERRORS):
                self.link.say_stopped(f"node {self.node_rank}'s launcher received {name}")
        self._stop(ranks)
        if self.link is not None and self.node_rank == 0:  # stay until the other nodes have
            deadline = time.monotonic() + self.timeout  # acknowledged why the job stopped
            with contextlib.suppress(*_STORE_ERRORS):
                while not self.link.others_saw_stop() and time.monotonic() < deadline:
                    time.sleep(POLL_SECONDS)
        return 128 + signum

    def _on_success(self, attempt: int) -> int:
        if self.link is None:
            return 0
        try:
            if self.link.finish(attempt) or self.node_rank != 0:
                return 0  # only node 0 must stay: it hosts the store the others still use
        except _STORE_ERRORS as exc:
            self._say(f"shardwise: node {self.node_rank}'s ranks finished, but the rendezvous "
                      f"store on node 0 is gone ({exc})")
            return 1
        deadline = time.monotonic() + self.timeout
        while not self.link.all_finished(attempt):  # node 0 hosts the store: keep it up
            trouble = self._remote_trouble(attempt, time.monotonic())
            if trouble is not None:
                self._say(trouble)
                return 1
            if time.monotonic() > deadline:
                self._say(f"shardwise: node {self.node_rank}'s ranks finished, but not every "
                          f"node's did within {self.timeout:g} s")
                return 1
            time.sleep(POLL_SECONDS)
        return 0

    def _on_failure(self, attempt, ranks, exits, watchdog) -> int:
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline and any(
                r.alive() or r.exit_time is None for r in ranks):
            self._drain(ranks, exits, watchdog, wait=0.05)
        for rank in ranks:  # the last lines of the ranks that exited, for the report
            if not rank.alive():
                for relay in rank.relays:
                    relay.join(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
        found = blame(self._exits(ranks))
        if found is not None:  # where the ranks it names are (unless they raised: the traceback
            # says where), before stopping them
            self._dump_stacks([r for r in ranks if r.rank in found.ranks and r.alive()
                               and not r.error_file.exists()])
        self._stop(ranks)
        found = blame(self._exits(ranks))
        if found is None:
            return 0
        return self._report(attempt, found)

    def _report(self, attempt: int, found: Blame) -> int:
        text, code = found.text, found.code
        if self.link is not None:
            remote = self._remote_cause(attempt, found)
            if remote is not None:  # the exit status of a node stopped from elsewhere
                text, code = remote, 1
            with contextlib.suppress(*_STORE_ERRORS):
                self.link.report_failure(attempt, text)
        self._say("\n" + text)
        return code

    def _remote_cause(self, attempt: int, found: Blame) -> str | None:
        """When this node's failures may have followed from elsewhere, the remote cause to say
        instead (another node's report, a node declared lost, or the store's host gone), else
        None.

        The node link is looked at once whatever the failure (so that a restart knows whether
        node 0 must be found again). A failure that only followed from elsewhere waits (up to the
        timeout) for the cause to show; a rank that crashed in native code waits only while
        some other node's launcher has not beaten since (a launcher that runs beats twice a
        second): a node that has gone silent is declared lost within the timeout, and when
        every node is alive the crash is this rank's own.
        """
        maybe_remote = found.consequence or found.native
        remote = self._remote_trouble(attempt, time.monotonic())
        if remote is not None and (maybe_remote or self.store_lost):
            return remote
        if not maybe_remote:
            return None
        since = time.monotonic()  # the look above put every node's beat in the link's view
        deadline = since + self.timeout + 1.0
        while time.monotonic() < deadline:
            time.sleep(0.25)
            remote = self._remote_trouble(attempt, time.monotonic())
            if remote is not None or found.native and self.link.beaten_since(since):
                return remote
        return None

    def _on_hang(self, attempt: int, ranks: list[_Rank], hang: Hang) -> int:
        hung = [r for r in ranks if r.rank in hang.ranks]
        self._dump_stacks(hung)
        self._stop(ranks)
        names = ", ".join(str(r.rank) for r in hung)
        text = f"shardwise: rank(s) {names} {hang.reason}; every rank was stopped."
        for rank in hung:
            text += f"\nrank {rank.rank} was at:\n{rank.stack}" if rank.stack else ""
        if self.link is not None:
            with contextlib.suppress(*_STORE_ERRORS):
                self.link.report_failure(attempt, text)
        self._say("\n" + text)
        return 1

    def _exits(self, ranks: list[_Rank]) -> list[RankExit]:
        return [RankExit(r.rank, r.proc.returncode, r.exit_time, r.stopped,
                         read_record(r.error_file), list(r.merged), list(r.relays[1].tail),
                         r.stack) for r in ranks]

    # -- processes -------------------------------------------------------------------------

    def _start(self, attempt: int, local: int, workdir: Path) -> _Rank:
        rank = self.layout.rank_offset + local
        error_file = workdir / f"rank_{rank}" / "error.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        env = self._rank_env(attempt, rank, local, error_file)
        progress_read, progress_write = os.pipe()  # [Note: progress records], progress.py
        env[PIPE_VAR] = str(progress_write)
        try:
            proc = subprocess.Popen(
                self.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=(self._read_end, progress_write),
            )
        except BaseException:
            os.close(progress_read)
            raise
        finally:
            os.close(progress_write)  # the rank holds it now
        prefix, merged = f"[rank{rank}]: ", deque(maxlen=400)
        relays = [PrefixedRelay(os.dup(proc.stdout.fileno()), prefix, self.stdout, self.lock,
                                merged=merged),
                  PrefixedRelay(os.dup(proc.stderr.fileno()), prefix, self.stderr, self.lock,
                                merged=merged)]
        proc.stdout.close()
        proc.stderr.close()
        for relay in relays:
            relay.start()
        return _Rank(rank, local, proc, relays, merged, error_file,
                     progress=ProgressPipe(progress_read))

    def _rank_env(self, attempt: int, rank: int, local: int, error_file: Path) -> dict[str, str]:
        env = dict(self.base_env)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(self.layout.world_size),
            LOCAL_WORLD_SIZE=str(self.nproc), GROUP_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.nnodes), ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(self.layout.world_size), MASTER_ADDR=self.host,
            MASTER_PORT=str(self.store.port), PYTHONUNBUFFERED="1",
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts),
        )
        env[AGENT_STORE_VAR] = "True"
        env[ERROR_FILE_VAR] = str(error_file)
        env[ATTEMPT_VAR] = self.attempt_id
        env[LAUNCHER_PID_VAR] = str(os.getpid())
        env[LAUNCHER_FD_VAR] = str(self._read_end)
        env[descendants.LAUNCH_ID_VAR] = self.launch_id
        env[GRACE_VAR] = repr(self.grace)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.nproc)))
        if huge_pages_on_request():  # [Note: huge pages for large tensors]
            env.setdefault(THP_VAR, "1")
        return env

    def _dump_stacks(self, ranks: list[_Rank]) -> None:
        """Ask each rank (that runs bootstrap.py, so has faulthandler on SIGUSR1) where it is."""
        asked = []
        for rank in ranks:
            if rank.published and rank.alive():
                with contextlib.suppress(ProcessLookupError):
                    asked.append((rank, rank.relays[1].count))
                    os.kill(rank.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 2.0
        for rank, before in asked:
            while time.monotonic() < deadline:
                lines = lines_since(rank.relays[1], before)
                if any(" in <module>" in line for line in lines):
                    time.sleep(0.1)  # the rest of the dump
                    break
                time.sleep(0.05)
            rank.stack = stack_dump(lines_since(rank.relays[1], before))

    def _stop(self, ranks: list[_Rank]) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after the grace
        period."""
        live = [r for r in ranks if r.alive()]
        for rank in live:
            rank.stopped = True
            _signal_group(rank.proc, signal.SIGTERM)
            _signal_group(rank.proc, signal.SIGCONT)  # a stopped (frozen) rank gets it too
        deadline = time.monotonic() + self.grace
        for rank in live:
            try:
                rank.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(rank.proc, signal.SIGKILL)
                rank.proc.wait()

    def _end_descendants(self, ranks: list[_Rank]) -> None:
        """End every process the ranks started that is still there (SIGTERM, the grace period,
        SIGKILL): [Note: a rank's descendants] in descendants.py."""
        left = descendants.end({r.proc.pid for r in ranks}, self.launch_id, self.grace)
        if left:
            self._say(f"shardwise: ended {len(left)} process(es) the ranks had started and left "
                      f"running (pids {', '.join(map(str, sorted(left)))})")

    def _say(self, text: str) -> None:
        """The launcher's own message, on a line of its own (never over a rank's bar)."""
        self.lock.write(self.stderr, text + "\n")


# [Note: huge pages for large tensors]
# A rank touches hundreds of MB of freshly mapped memory per training step on the CPU (FSDP's
# gathered units, gradients, activations after the heap is trimmed, optimizer temporaries), and
# the kernel maps it one 4 KiB page per fault. torch's CPU allocator asks for transparent huge
# pages (2 MiB: one fault where there were 512) on every allocation of at least 2 MiB when its
# process starts with THP_MEM_ALLOC_ENABLE=1; smaller allocations are unchanged. The launcher
# sets it for its ranks, unless the environment already says otherwise, when the kernel grants
# huge pages on request (/sys/kernel/mm/transparent_hugepage/enabled is ``always`` or
# ``madvise``); under torchrun, set it yourself. Measured: docs/benchmarks-history.md.
THP_VAR = "THP_MEM_ALLOC_ENABLE"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_on_request(mode_file: str = THP_MODE) -> bool:
    """Whether this kernel maps transparent huge pages where a process asks for them."""
    try:
        with open(mode_file) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
