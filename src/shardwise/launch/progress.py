"""Progress records: each rank says, through the rendezvous store, how far it has got.

[Note: progress records] A background thread in every rank started by our launcher writes, once
per interval, the key ``shardwise/progress/attempt_<k>/rank_<r>`` = JSON ``{"seq": ..., "beats":
..., "t": ...}``: ``seq`` is the number of collectives this rank has entered on the default
process group (c10d's own sequence number), ``beats`` counts calls to ``beat()`` (a training loop
calls it once per step), ``t`` is the wall time of the write. Two readers use them:

* a rank whose collective timed out compares its own ``seq`` with the others': the ranks behind
  it never reached that collective, and its failure record names them (errors.py);
* the launcher's watchdog: a record that stops changing means the rank stopped (no heartbeat),
  and ``seq``/``beats`` that stop changing mean it is alive but makes no progress.

Reads and writes go through the thread's own store client, under a lock, never the client the
process group uses.

Records are signed (distributed/signed_store.py, [Note: launcher records] in job_secret.py)
under the secret the launcher handed its ranks and the attempt's identity (``scope_of``, from
``$SHARDWISE_ATTEMPT_ID``: agreed by the nodes, or drawn by a one-node launcher), so a record
copied from another job or attempt fails; they carry a count ``n`` that only grows: a reader
ignores (and logs) a record that fails its MAC, and reports a record older than one it has seen
(a genuine record written back by someone else) as false too.

The store cannot prove a rank alive, though: anyone who reaches its port can delete a record,
or write a genuine one back again and again, and a rank then looks frozen although its MAC
holds. So the watchdog does not read the store. Our launcher gives each rank one end of a pipe
of its own (``$SHARDWISE_PROGRESS_FD``), and the heartbeat writes every record there too, one
JSON line each; the launcher reads the other end (``ProgressPipe``). No other process holds
either end, so what the watchdog judges by is what the rank wrote, and no one without the
secret can make a rank look frozen. The store's copies serve the ranks' own question, who never
reached a collective (``stragglers``), and a rank whose record is missing or false there is not
named: no one is.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from shardwise._compat import sequence_number
from shardwise.distributed import signed_store

PREFIX = "shardwise/progress/"
PIPE_VAR = "SHARDWISE_PROGRESS_FD"  # the write end of this rank's pipe to its launcher
SCOPE = "shardwise-launcher"  # signed_store's scope of the launcher's records
ATTEMPT_VAR = "SHARDWISE_ATTEMPT_ID"  # the attempt's identity (hex), which binds its records
_beats = 0


class FalseRecord:
    """What ``read_progress`` returns for a record that fails its MAC or goes back in time."""


FALSE = FalseRecord()


def scope_of(attempt_id: str) -> str:
    """The signed scope of one attempt's progress records (``attempt_id``: hex, from the
    launcher): a record copied from another job or attempt fails its MAC."""
    return f"{SCOPE}|attempt={attempt_id}"


def progress_key(attempt: int, rank: int) -> str:
    return f"{PREFIX}attempt_{attempt}/rank_{rank}"


def beat() -> None:
    """Count one unit of progress (a training step) for the launcher's watchdog."""
    global _beats
    _beats += 1


def collective_count() -> int:
    """Collectives entered on the default group so far; -1 before the group exists."""
    try:
        if not dist.is_initialized():
            return -1
        return sequence_number(dist.group.WORLD)
    except (RuntimeError, AttributeError, ValueError):
        return -1


def parse_record(raw: bytes | str | None) -> dict[str, Any] | None:
    """A progress record as written by ``Heartbeat``; None for anything else."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        return {"seq": int(record["seq"]), "beats": int(record["beats"]),
                "t": float(record["t"]), "n": int(record.get("n", 0)),
                "exiting": bool(record.get("exiting", False))}
    except (ValueError, KeyError, TypeError):
        return None


def read_progress(store: dist.Store, attempt: int, rank: int, secret: bytes,
                  newest: dict[str, Any] | None = None, scope: str = SCOPE
                  ) -> dict[str, Any] | FalseRecord | None:
    """Rank ``rank``'s latest record; None if it has written none; ``FALSE`` for a record
    that is not a true one of this job (fails its MAC, or is older than ``newest``, a record
    read before). Never blocks."""
    key = progress_key(attempt, rank)
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        record = parse_record(signed_store.open_record(key, raw, secret, scope))
    except signed_store.BadRecord as why:
        signed_store._warn_once(key, bytes(raw), why)
        return FALSE
    if record is None:
        return FALSE
    if newest is not None and record["n"] < newest["n"]:
        signed_store._warn_once(key, bytes(raw), signed_store.BadRecord(
            f"store record {key!r} is an older record of rank {rank} written back"))
        return FALSE
    return record


class Heartbeat(threading.Thread):
    """Publishes this rank's progress record every ``interval`` seconds until ``stop()``."""

    def __init__(self, store: dist.Store, attempt: int, rank: int, world_size: int,
                 interval: float, secret: bytes, pipe_fd: int | None = None,
                 scope: str = SCOPE):
        super().__init__(daemon=True, name="shardwise-heartbeat")
        self.store, self.attempt, self.rank, self.scope = store, attempt, rank, scope
        self.pipe_fd = pipe_fd  # the launcher reads the records here ([Note: progress records])
        if pipe_fd is not None:
            os.set_blocking(pipe_fd, False)  # a full pipe drops a record, never blocks a rank
        self.secret, self._count = secret, 0
        self.world_size, self.interval = world_size, interval
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.publish()
            except (RuntimeError, dist.DistError, OSError):
                return  # the store (the launcher) is gone; the lifeline handles that
            self._stopped.wait(self.interval)

    def publish(self, exiting: bool = False) -> None:
        """Write this rank's record; ``exiting``: its script is done and the interpreter is
        tearing down (no more records: the launcher is patient with it, see watchdog.py)."""
        with self._lock:
            self._count += 1
            record = {"seq": collective_count(), "beats": _beats, "t": time.time(),
                      "n": self._count, "pid": os.getpid(), "exiting": exiting}
            self._to_launcher(json.dumps(record))
            signed_store.put(self.store, progress_key(self.attempt, self.rank),
                             json.dumps(record), self.secret, self.scope)

    def _to_launcher(self, line: str) -> None:
        """One record on the pipe; a full pipe (the launcher reads it a few times a second)
        drops it, and a closed one (the launcher is gone) raises OSError, which ends the
        thread."""
        if self.pipe_fd is None:
            return
        with contextlib.suppress(BlockingIOError):  # one line is below PIPE_BUF: atomic
            os.write(self.pipe_fd, (line + "\n").encode())

    def stop(self) -> None:
        self._stopped.set()

    def stragglers(self) -> list[int]:
        """Ranks whose published collective count is behind this rank's: those that never
        reached the collective this rank is waiting in (empty when unknown, or when some rank's
        record is false: then no one can be named)."""
        mine = collective_count()
        if mine < 0:
            return []
        behind = []
        with self._lock:
            for rank in range(self.world_size):
                if rank == self.rank:
                    continue
                try:
                    record = read_progress(self.store, self.attempt, rank, self.secret,
                                           scope=self.scope)
                except (RuntimeError, dist.DistError, OSError):
                    return []
                if record is FALSE or record is None:  # no evidence: name no one
                    return []
                if record["seq"] < mine:
                    behind.append(rank)
        return behind


class ProgressPipe:
    """The launcher's end of one rank's pipe: the newest record the rank wrote there."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._partial = b""
        self.record: dict[str, Any] | None = None

    def latest(self) -> dict[str, Any] | None:
        """Read what the rank wrote since the last call (never blocks); the newest whole
        record so far, or None before the first."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:  # the rank closed it (exited)
                break
            self._partial += chunk
        *lines, self._partial = self._partial.split(b"\n")
        for line in reversed(lines):
            record = parse_record(line)
            if record is not None:
                self.record = record
                break
        return self.record

    def close(self) -> None:
        os.close(self.fd)
