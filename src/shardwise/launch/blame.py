"""Which rank to blame for a failed job, and the report that says so (see [Note: blame] in
errors.py). Pure: the launcher gathers the facts, this decides and words them."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

from shardwise.launch.errors import FailureRecord, root_cause, says_consequence
from shardwise.launch.output import last_traceback


@dataclass
class RankExit:
    """What the launcher knows about one rank once the job has stopped."""

    rank: int
    code: int | None  # Popen's returncode: negative for a signal; None: still running
    time: float | None  # wall time the launcher saw the exit
    stopped: bool  # the launcher itself signalled it (after another rank failed)
    record: FailureRecord | None
    output: list[str] = field(default_factory=list)  # its last lines, stdout and stderr merged
    stderr: list[str] = field(default_factory=list)  # its last stderr lines
    stack: str = ""  # where it was, when the launcher asked for a stack dump


@dataclass(frozen=True)
class Blame:
    ranks: list[int]
    text: str
    code: int  # the launcher's exit status
    # no failure of its own was found: the cause may be elsewhere (ranks that never arrived
    # may sit on another node)
    consequence: bool = False
    # killed by a signal it did not get from the launcher, with no Python error: a crash in
    # native code, which is also how some ranks die when a peer node goes away (gloo's or the
    # store's client aborting); the launcher looks for a remote cause before blaming the rank
    native: bool = False


_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ")  # torch's excepthook prefixes a rank's traceback


def _plain(lines: list[str]) -> list[str]:
    return [_TORCH_PREFIX.sub("", line) for line in lines]


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def blame(exits: list[RankExit]) -> Blame | None:
    """The root cause among ``exits``; None when nothing failed.

    A failure that is not a consequence comes first. Else, a rank that left on its own (exit
    code 0: a failure would be the rule above) while the others still needed it is the cause,
    and the consequence follows it in the report."""
    for e in exits:
        e.stderr, e.output = _plain(e.stderr), _plain(e.output)
    found, consequence = _cause(exits)
    if found is None or not consequence:
        return found
    left = [e for e in exits if e.code == 0 and not e.stopped and e.time is not None]
    if not left:
        return found
    return _blame_leaver(min(left, key=lambda e: e.time), exits, found)


def _blame_leaver(first: RankExit, exits: list[RankExit], then: Blame) -> Blame:
    """Rank ``first`` left (exit code 0) before the job was done; ``then`` is what followed."""
    when = []
    for e in sorted(exits, key=lambda e: e.rank):
        at = e.record.time if e.record is not None else e.time if not e.stopped else None
        if e is first or at is None:
            continue
        gap = at - first.time
        verb = "failed" if e.code != 0 or e.record is not None else "left"
        when.append(f"{gap:.2f} s before rank {e.rank} {verb}" if gap >= 0 else
                    f"{-gap:.2f} s after rank {e.rank} {verb} (as the launcher saw them)")
    relative = f", {', '.join(when)}" if when else ""
    text = (f"shardwise: rank {first.rank} left first (exit code 0{relative}) while the other "
            f"ranks still needed it; the other ranks were stopped.\n"
            f"then: {then.text.removeprefix('shardwise: ').replace(_STOPPED, '.', 1)}")
    return Blame([first.rank], text, 1)


_STOPPED = "; the other ranks were stopped."


def _cause(exits: list[RankExit]) -> tuple[Blame | None, bool]:
    """The root cause by the rules of [Note: blame], and whether it is only a consequence."""
    by_rank = {e.rank: e for e in exits}
    own = [e for e in exits if e.code not in (None, 0) and not e.stopped]
    candidates = [(e.record.time, e) for e in exits if e.record and not e.record.consequence]
    candidates += [(e.time or 0.0, e) for e in own if e.record is None
                   and not says_consequence(last_traceback(e.stderr)[-300:])]
    if candidates:
        return _blame_one(min(candidates, key=lambda c: c[0])[1]), False
    cause = root_cause([e.record for e in exits if e.record])
    if cause is not None and cause.waiting_for:
        return _blame_missing(cause, [by_rank[r] for r in cause.waiting_for if r in by_rank]), \
            True
    if cause is not None:
        return _blame_one(by_rank[cause.rank]), True
    if own:  # only consequences, none recorded: the first to go
        return _blame_one(min(own, key=lambda e: e.time or 0.0)), True
    return None, False


def _blame_one(e: RankExit) -> Blame:
    stopped = _STOPPED
    if e.record is not None:
        how = _how(e.code) if e.code not in (None, 0) and not e.stopped else "it raised"
        kind = " (a consequence: a peer went away or timed out)" if e.record.consequence else ""
        return Blame([e.rank], f"shardwise: rank {e.rank} failed ({how}){kind}{stopped}\n"
                     f"rank {e.rank}'s error:\n{e.record.traceback.rstrip()}",
                     1 if e.stopped else _status(e.code), e.record.consequence)
    if e.code is not None and e.code < 0:
        return Blame([e.rank], f"shardwise: rank {e.rank} was killed by {signal_name(-e.code)}"
                     f"{stopped}\n{_output(e)}", _status(e.code), native=True)
    trace = last_traceback(e.stderr) if any(
        line.startswith("Traceback (most recent") for line in e.stderr) else ""
    if trace:
        return Blame([e.rank], f"shardwise: rank {e.rank} failed ({_how(e.code)}){stopped}\n"
                     f"rank {e.rank}'s error:\n{trace}", _status(e.code))
    return Blame([e.rank], f"shardwise: rank {e.rank} failed ({_how(e.code)}) without a Python "
                 f"exception{stopped}\n{_output(e)}", _status(e.code))


def _blame_missing(cause: FailureRecord, missing: list[RankExit]) -> Blame:
    names = ", ".join(str(e.rank) for e in missing) or ", ".join(map(str, cause.waiting_for))
    text = (f"shardwise: rank(s) {names} never reached the collective that rank {cause.rank} "
            f"waited in; rank {cause.rank} gave up: {cause.summary()}\n"
            "the other ranks were stopped.")
    for e in missing:
        if e.stack:
            text += f"\nrank {e.rank} was at:\n{e.stack}"
    return Blame(sorted(cause.waiting_for), text, 1, consequence=True)


def _how(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"exit code {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def _status(code: int | None) -> int:
    if not code:
        return 1
    return code if code > 0 else 128 - code


def _output(e: RankExit) -> str:
    if not e.output:
        return f"rank {e.rank} wrote no output."
    lines = "\n".join(f"  | {line}" for line in e.output[-20:])
    return f"rank {e.rank}'s last output lines (its output, not an error message):\n{lines}"
