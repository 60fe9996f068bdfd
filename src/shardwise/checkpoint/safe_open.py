"""Opening a checkpoint's files for reading: no file in the place of one can block a reader or
stand in for it. [Note: opening checkpoint files]

[Note: opening checkpoint files]
Every file a reader opens (``metadata.json``, the data files, a run's ``latest``, the records a
save leaves in its temporary directory) goes through ``open_regular``:

- ``os.open`` with ``O_NONBLOCK``: opening a FIFO for reading returns at once instead of waiting
  for a writer, and a UNIX socket fails at once (ENXIO); ``O_NOFOLLOW``: a symbolic link in the
  file's place fails (ELOOP), so a link to ``/dev/zero``, to a FIFO or to a file outside the
  checkpoint is never followed; ``O_CLOEXEC``: no child inherits the descriptor.
- ``os.fstat`` of the descriptor must say "regular file" before a byte is read; a directory, a
  FIFO, a socket or a device is refused. The check is on what was opened, so a file swapped
  after the validator's ``lstat`` is still caught.

A refusal is a ``CheckpointError`` naming the file and what it is ("a FIFO (named pipe)", "a
symbolic link (to /dev/null)", ...). ``read_bounded`` also refuses a file larger than a bound,
judged by ``fstat`` before anything is read, and reads at most the bound plus one byte (a file
that grows after the check is refused too).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from shardwise.checkpoint.errors import CheckpointError

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a UNIX socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, words in _KINDS:
        if test(mode):
            return words
    return "a special file"


def describe(path: Path) -> str:
    """What ``path`` itself is (a link is not followed; its target is named)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    return kind_of(mode)


def not_regular(path: Path, what: str, kind: str) -> CheckpointError:
    """The error for a checkpoint file that is not a regular file."""
    return CheckpointError(f"{what} {path} is {kind}, not a regular file; every file of a "
                           "checkpoint must be a regular file inside it")


def open_regular(path: str | os.PathLike, what: str = "checkpoint file") -> BinaryIO:
    """``path`` opened for binary reading, known to be a regular file reached without a link
    (see the Note); a CheckpointError naming it and what it is otherwise. A missing file raises
    FileNotFoundError, for the caller to put in its own words."""
    path = Path(path)
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as err:
        kind = describe(path)
        if kind != "a regular file" and not kind.startswith("unreadable"):
            raise not_regular(path, what, kind) from None
        raise CheckpointError(f"cannot open {what} {path}: {err.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, what, kind_of(mode))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, what: str = "checkpoint file",
                 hint: str = "") -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), refused (before any read) when
    it holds more than ``limit`` bytes; ``hint`` says how to raise the bound."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(raw) > limit:
        held = max(size, len(raw))
        more = "at least " if len(raw) > limit else ""
        raise CheckpointError(f"{what} {path} holds {more}{held} bytes, more than the bound of "
                              f"{limit} bytes{hint}")
    return raw
