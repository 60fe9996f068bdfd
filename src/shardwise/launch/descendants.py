"""Every process a rank started ends with the job (standard library only: a rank loads this
file before it imports anything heavy, see rank_boot.py).

[Note: a rank's descendants] A rank may start processes of its own (a data loader's workers, a
tool run with ``subprocess``), and such a process may ignore SIGTERM or leave the rank's process
group. Three things find them, so that none outlives the job whichever way the job ends:

* each rank runs in its own session (``start_new_session``), so the rank's pid is the session id
  and the process group id of everything it starts, unless a descendant calls ``setsid`` or
  ``setpgid``;
* every rank's environment carries the job's launch id (``SHARDWISE_LAUNCH_ID``, random per
  ``launch``), which its descendants inherit with the environment and keep in
  ``/proc/<pid>/environ`` even when they leave the session;
* ``members`` lists the live processes of this user that are in a rank's session or process
  group, or whose environment carries the launch id; ``end`` sends them SIGTERM, waits up to the
  grace period for them to go, then SIGKILLs what is left, looking again until none is found
  (killing a parent makes its children orphans, which are still found by the same marks).

The launcher calls ``end`` at the end of every attempt: success, failure, a hang, a signal to
the launcher. When the launcher is killed outright (SIGKILL) it can do nothing; then each rank's
*guard* does it: a small process the rank forks before it imports anything (``start_guard``),
which stays in the rank's session, ignores the signals the launcher sends ranks, and blocks
on the launcher's lifeline pipe. End-of-file there means the launcher is gone: the guard SIGKILLs
every member of its rank's session and of the launch, and exits. It exits on its own, quietly,
once its rank has exited while the launcher lives (the launcher's ``end`` handles what is left).

Out of reach: a descendant that both leaves the rank's session and starts with an environment
that lacks the launch id, on Linux; elsewhere (no ``/proc``) only the rank's process group.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

LAUNCH_ID_VAR = "SHARDWISE_LAUNCH_ID"
GUARD_NAME = "shardwise-guard"  # a guard's /proc/<pid>/comm
_PROC = "/proc"
_PF_EXITING = 0x4  # a task's flag (/proc/<pid>/stat, field 9) from the start of its exit
_SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # its bit in SigPnd/ShdPnd of /proc/<pid>/status


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, sid, state) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0].decode()


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def members(sessions: set[int], launch_id: str | None, exclude: set[int] = frozenset()) -> \
        list[int]:
    """Live processes of this user in one of ``sessions`` (session or process group ids) or
    whose environment carries ``launch_id``; never this process nor ``exclude``."""
    if not os.path.isdir(_PROC):
        return [s for s in sessions if _group_alive(s)]
    marker = f"{LAUNCH_ID_VAR}={launch_id}".encode() if launch_id else None
    me, uid, found = os.getpid(), os.getuid(), []
    for name in os.listdir(_PROC):
        if not name.isdigit() or int(name) == me or int(name) in exclude:
            continue
        pid = int(name)
        with contextlib.suppress(OSError):
            if os.stat(f"{_PROC}/{name}").st_uid != uid:
                continue
            info = _stat(pid)
            if info is None or info[3] in ("Z", "X"):
                continue
            if info[1] in sessions or info[2] in sessions or (
                    marker is not None and _carries(pid, marker)):
                found.append(pid)
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_all(sessions: set[int], launch_id: str | None, exclude: set[int] = frozenset(),
             rounds: int = 20) -> None:
    """SIGKILL every member, looking again (orphans of the killed) until none is left."""
    for _ in range(rounds):
        found = members(sessions, launch_id, exclude)
        if not found:
            return
        _send(found, signal.SIGKILL)
        for pgid in sessions - {os.getpgid(0)}:  # (a guard is in its rank's group)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.02)


def is_guard(pid: int) -> bool:
    try:
        with open(f"{_PROC}/{pid}/comm") as f:
            return f.read().strip() == GUARD_NAME
    except OSError:
        return False


def end(sessions: set[int], launch_id: str | None, grace: float,
        exclude: set[int] = frozenset()) -> list[int]:
    """SIGTERM every member, wait up to ``grace`` seconds for them to exit, SIGKILL the rest;
    the pids that were found at first, guards left out (empty when there was nothing to
    end)."""
    first = members(sessions, launch_id, exclude)
    if not first:
        return []
    reported = [pid for pid in first if not is_guard(pid)]
    _send(first, signal.SIGTERM)
    _send(first, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not members(sessions, launch_id, exclude):
            return reported
        time.sleep(0.1)
    kill_all(sessions, launch_id, exclude)
    return reported


def start_guard(lifeline_fd: int, launch_id: str | None) -> int | None:
    """Fork this rank's guard (see the Note above); its pid, or None where fork is missing.

    Call it before any thread starts: the child runs Python after ``fork``."""
    if not hasattr(os, "fork"):
        return None
    rank, launcher = os.getpid(), os.getppid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the guard: nothing but the lifeline open, deaf to the launcher's stop signals
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, lifeline_fd)
        os.closerange(lifeline_fd + 1, 65536)
        with contextlib.suppress(OSError), open(f"{_PROC}/self/comm", "w") as f:
            f.write(GUARD_NAME)
        _guard(lifeline_fd, rank, launch_id, launcher)
    finally:
        os._exit(0)


def _guard(fd: int, rank: int, launch_id: str | None, launcher: int) -> None:
    rank_fd = _pidfd(rank)  # readable when the rank exits (Linux 5.3+); else polled
    watched = [fd] if rank_fd is None else [fd, rank_fd]
    while True:
        readable, _, _ = select.select(watched, [], [], 0.1 if rank_fd is None else None)
        if fd in readable and not _read_quietly(fd):
            kill_all({rank}, launch_id)  # the launcher is gone
            return
        if rank_fd in readable or os.getppid() != rank:
            # the rank exited; the launcher (alive) takes care of what it left, unless it is
            # going too. A launcher killed outright may kill the rank (PR_SET_PDEATHSIG fires
            # when the launcher's thread that started the rank exits) before its last thread
            # exits and closes its end of the pipe: so a launcher on its way out counts as gone
            readable, _, _ = select.select([fd], [], [], 0.05)
            if (readable and not _read_quietly(fd)) or exiting(launcher):
                kill_all({rank}, launch_id)
            return


def exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone, a zombie, or on its way out: killed (SIGKILL pending)
    or its first thread exiting (False where there is no /proc to tell)."""
    if not os.path.isdir(_PROC):
        return False
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"{_PROC}/{pid}/status", "rb") as f:
            status = f.read().splitlines()
    except (OSError, IndexError):
        return True
    if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return True
    return any(int(line.split()[1], 16) & _SIGKILL_PENDING for line in status
               if line.startswith((b"SigPnd:", b"ShdPnd:")))


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _read_quietly(fd: int) -> bytes:
    try:
        return os.read(fd, 1)
    except OSError:
        return b""
