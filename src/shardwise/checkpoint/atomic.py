"""Writing files so that a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    """Write ``text`` to a temporary name, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
