"""Per-rank failure records: which rank failed first, and which failures only followed from it.

[Note: blame] When one rank dies, its peers fail moments later in their collectives ("Connection
reset by peer", "Connection closed by peer", a timeout). Exit order does not say who was first: a
rank that raises may spend longer tearing down than its peer takes to notice the closed socket.
So every rank writes down its own failure (type, message, traceback, wall time, and whether it is
a *consequence*: a closed or reset connection or a timeout) before it exits, in the file named by
``TORCHELASTIC_ERROR_FILE`` (the variable torchrun's agent sets; our launcher sets it too). The
launcher then reports the root cause: the earliest failure that is not a consequence. A timed-out
rank also records which ranks never reached the collective it waited in (see progress.py), so
that when every failure is a consequence, the ranks that never arrived are the ones named.
Two more rules (launch/blame.py): a rank that wrote no record (it died before it could) is
judged by the last traceback on its stderr, at the time the launcher saw it exit, and with
no traceback at all it is a failure of its own; and when every failure is a consequence, a
rank that left on its own with exit code 0 while the others still needed it is named first,
the consequences after it.

The file is JSON in torchrun's layout (``message.message``, ``message.extraInfo.py_callstack``,
``message.extraInfo.timestamp``) with shardwise's fields under ``"shardwise"``.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardwise.distributed.env import str_var

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"

# Lower-case fragments of the messages c10d/gloo/NCCL and our own code give when a peer went away
# or never came: the failure of a rank whose peer failed first.
_CONSEQUENCE_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
    "timeout after", "wait timeout", "socket closed", "connection refused",
    "nccl communicator was aborted", "connection was likely closed",
    "exited while the others waited",  # dp/shm_reduce.py: a peer of the shared-memory path died
)


@dataclass
class FailureRecord:
    """One rank's own account of how it failed."""

    rank: int
    type: str
    message: str
    traceback: str
    time: float  # wall clock, seconds since the epoch
    consequence: bool  # a closed/reset connection or a timeout: probably caused by another rank
    waiting_for: list[int] = field(default_factory=list)  # ranks that never reached a collective
    where: str = ""  # the collective waited in, when known

    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


def is_consequence(exc: BaseException) -> bool:
    """True when ``exc`` (or what it was raised from) says a connection closed or timed out."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (TimeoutError, ConnectionError)):
            return True
        if "Timeout" in type(exc).__name__:
            return True
        if any(marker in str(exc).lower() for marker in _CONSEQUENCE_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def says_consequence(text: str) -> bool:
    """True when an error message (e.g. a traceback's last line) reads like a consequence."""
    return any(marker in text.lower() for marker in _CONSEQUENCE_MARKERS)


def is_timeout(exc: BaseException) -> bool:
    """True when ``exc`` (or what it was raised from) says a wait timed out."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__ or any(
                marker in text for marker in ("timed out", "timeout after", "wait timeout")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def failure_of(exc: BaseException, rank: int, waiting_for: list[int] | None = None,
               where: str = "") -> FailureRecord:
    """The record of ``exc`` as raised on ``rank`` now."""
    return FailureRecord(
        rank=rank, type=type(exc).__name__, message=str(exc),
        traceback="".join(traceback.format_exception(exc)), time=time.time(),
        consequence=is_consequence(exc), waiting_for=sorted(waiting_for or []), where=where,
    )


def write_record(record: FailureRecord, path: str | os.PathLike | None = None) -> Path | None:
    """Write ``record`` to ``path`` (default: ``$TORCHELASTIC_ERROR_FILE``); None when unset.

    The write goes to a temporary name first, so a reader never sees half a record.
    """
    path = path or str_var(ERROR_FILE_VAR)
    if not path:
        return None
    path = Path(path)
    body = {"message": {"message": record.summary(), "extraInfo": {
        "py_callstack": record.traceback, "timestamp": str(int(record.time))}},
        "shardwise": asdict(record)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
    return path


def read_record(path: str | os.PathLike) -> FailureRecord | None:
    """The record in ``path``; None when there is none or it is not a shardwise record."""
    try:
        body = json.loads(Path(path).read_text())
        fields = body["shardwise"]
        return FailureRecord(
            rank=int(fields["rank"]), type=str(fields["type"]), message=str(fields["message"]),
            traceback=str(fields["traceback"]), time=float(fields["time"]),
            consequence=bool(fields["consequence"]),
            waiting_for=[int(r) for r in fields.get("waiting_for", [])],
            where=str(fields.get("where", "")),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def root_cause(records: list[FailureRecord]) -> FailureRecord | None:
    """The earliest failure that is not a consequence; else the earliest that names missing
    ranks; else the earliest. None for no records."""
    if not records:
        return None
    for pick in ([r for r in records if not r.consequence], [r for r in records if r.waiting_for],
                 records):
        if pick:
            return min(pick, key=lambda r: r.time)
    return None
