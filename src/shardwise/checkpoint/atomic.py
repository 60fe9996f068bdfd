"""Creating checkpoint files: exclusively, never through a link, and complete under the final
name or not at all.

Every file a checkpoint write creates is opened with ``O_CREAT | O_EXCL | O_NOFOLLOW``: if
anything already sits at the name (a file, or a symbolic link another user planted to make us
overwrite one of theirs) the open fails instead of writing through it. Files that replace
another by name (``latest``, an exported safetensors file) are written under a temporary name
with 64 random bits in it, fsynced, then renamed over the final name.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import IO

_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def create_exclusive(path: str | os.PathLike, text: bool = False) -> IO:
    """A new file at ``path`` opened for writing; ``FileExistsError`` if anything (a symbolic
    link included) is there already. Mode 0666 less the umask, as ``open`` would give."""
    fd = os.open(path, _EXCLUSIVE, 0o666)
    return os.fdopen(fd, "w" if text else "wb")


def temp_name(path: Path) -> Path:
    """An unpredictable temporary name beside ``path``."""
    return path.with_name(f"{path.name}.tmp-{secrets.token_hex(8)}")


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    """Write ``text`` to a new temporary file beside ``path``, fsync, then rename over it."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with create_exclusive(tmp, text=True) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
