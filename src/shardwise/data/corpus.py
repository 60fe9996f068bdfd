"""A real text corpus on every machine without a download: the Python standard library's sources.

Files are found through ``sysconfig``, read in a fixed (sorted) order, and assigned to train or
validation by a hash of their path, so the split is the same on every run and on every rank.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # 1D uint8, bytes of the training files
    val: torch.Tensor  # 1D uint8, bytes of the validation files
    n_files: int


def stdlib_sources() -> list[Path]:
    """Every ``.py`` file of the standard library (not site-packages), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no Python sources found under the standard library at {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1) -> Corpus:
    """Read up to ``max_bytes`` of sources; about ``val_fraction`` of files go to validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, total, n_files = bytearray(), bytearray(), 0, 0
    for path in stdlib_sources():
        text = path.read_bytes() + b"\n"
        key = zlib.crc32(path.relative_to(root).as_posix().encode()) % 1000
        (val if key < val_fraction * 1000 else train).extend(text)
        total += len(text)
        n_files += 1
        if total >= max_bytes:
            break
    if not train or not val:
        raise ValueError(f"max_bytes={max_bytes} is too small to give both a train and a val split")
    return Corpus(_as_tensor(train), _as_tensor(val), n_files)


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).clone()
