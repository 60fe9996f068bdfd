"""Files only this user may read: the checks that the launcher's job secret
(launch/job_secret.py) and the RPC group secret (rpc/trust/secret.py) both apply, so that each
secret is trusted on the same terms. No collective happens here.

A secret file is trusted only when the file actually opened (``fstat`` of the descriptor, not
the name, so a link swapped in between proves nothing) is a regular file owned by this user
that neither group nor others may read or write; a directory that holds secrets is refused
unless it is this user's, mode 0700, and not a link.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from shardwise.distributed.env import RPC_SECRET_FILE_VAR, RPC_SECRET_VAR, str_var

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # (a FIFO never blocks)


def read_private_file(path: str | Path, what: str, error: type[Exception]) -> bytes:
    """The stripped contents of ``path`` (``what`` names it in messages); ``error`` if the file
    cannot be read, is empty, or is not a private regular file of this user."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
        try:
            check_private_file(os.fstat(fd), f"{what} {path}", error)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read().strip()
        finally:
            os.close(fd)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc}") from exc
    if not data:
        raise error(f"{what} {path} is empty")
    return data


def user_secret(lookup: Callable[[str], str | None], error: type[Exception]) -> bytes | None:
    """The secret the user set: ``$SHARDWISE_RPC_SECRET``, else the contents of the private
    file named by ``$SHARDWISE_RPC_SECRET_FILE``; None when neither is set. ``lookup`` reads a
    variable (this process's, or the environment a launcher gives its ranks): RPC's rendezvous
    and the launcher share this one rule. ``error`` is raised for a file not to be trusted."""
    value = lookup(RPC_SECRET_VAR)
    if value:
        return value.encode()
    path = lookup(RPC_SECRET_FILE_VAR)
    return read_private_file(path, f"${RPC_SECRET_FILE_VAR} file", error) if path else None


def check_private_file(info: os.stat_result, what: str, error: type[Exception]) -> None:
    """Raise ``error`` unless ``info`` is a regular file of this user closed to others."""
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} is not a regular file")
    if info.st_uid != os.geteuid():
        raise error(f"{what} is owned by uid {info.st_uid}, not by this user (uid "
                    f"{os.geteuid()}): its owner could have chosen the secret; use a file of "
                    "your own")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise error(f"{what} is readable or writable by group or others (mode "
                    f"{stat.S_IMODE(info.st_mode):o}); chmod 600 it")


def private_dir(name: str, hint: str, error: type[Exception]) -> Path:
    """``$XDG_RUNTIME_DIR/NAME`` or ``/tmp/NAME-UID``, created 0700; ``error`` (with ``hint``,
    what else the user can do) if it is a link, someone else's, or open to others."""
    base = str_var("XDG_RUNTIME_DIR")
    path = Path(base) / name if base else Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
            or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise error(f"{path} is not a private directory of this user (mode 0700); remove it, "
                    f"or {hint}")
    return path


def host_identity() -> str:
    """This host's identity: the machine id where there is one, else the hostname."""
    with contextlib.suppress(OSError):
        text = Path("/etc/machine-id").read_text().strip()
        if text:
            return f"machine:{text}"
    return f"host:{socket.gethostname()}"
