"""A training run's checkpoints: one sharded checkpoint (see saver.py) per saved step.

Layout under the checkpoint directory::

    step_000200/metadata.json    the sharded checkpoint of step 200 (format.py); its values hold
    step_000200/rank_0000N.bin   "train": this module's JSON record of what wrote it (model
                                 config, strategy, world size, step, seed, ...)
    latest                       the name of the newest complete step directory

A step directory appears only by the atomic rename that completes its save, and ``latest`` is
rewritten (atomically) only after that, so a crash at any moment leaves ``latest`` naming a
complete checkpoint. Nothing here unpickles: the record is JSON inside the JSON metadata.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from shardwise.checkpoint.atomic import atomic_write_text
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.safe_open import read_bounded
from shardwise.checkpoint.validate import read_metadata

LATEST = "latest"
TRAIN_KEY = "train"  # the values entry holding the run's record
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"step_\d+")
_POINTER_BYTES = 4096  # ``latest`` holds one directory name
# the record's required fields and their types
_META_FIELDS = {"model": dict, "strategy": str, "world_size": int, "step": int}


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def mark_latest(directory: str | Path, path: str | Path) -> None:
    """Point ``latest`` at the complete checkpoint ``path`` (call on one rank)."""
    atomic_write_text(Path(path).name, Path(directory) / LATEST)


def latest_checkpoint(directory: str | Path) -> Path:
    """The newest complete checkpoint in ``directory``; a clear error if there is none.

    ``latest`` may only name a ``step_N`` directory directly inside ``directory``: a pointer to
    anywhere else (``../other/step_000040``, an absolute path) is refused, so that a resume never
    loads state from outside the checkpoint directory.
    """
    pointer = Path(directory) / LATEST
    name = _pointer_name(pointer)
    if name is None:
        raise CheckpointError(f"no checkpoint to resume from in {directory} (no '{LATEST}' file)")
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory "
                              f"inside {directory} (expected step_NNNNNN)")
    path = Path(directory) / name
    if not os.path.lexists(path / METADATA):  # what it is, if not a file: read_metadata says
        raise CheckpointError(f"checkpoint {path} is incomplete (no {METADATA})")
    return path


def _pointer_name(pointer: Path) -> str | None:
    """The name ``latest`` holds (None: there is no ``latest``); read as every checkpoint file
    is (safe_open.py: a FIFO or a link in its place is refused by name, not waited on)."""
    try:
        raw = read_bounded(pointer, _POINTER_BYTES, "checkpoint pointer")
    except FileNotFoundError:
        return None
    try:
        return raw.decode().strip()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"cannot read {pointer}: {exc}") from None


def read_meta(path: str | Path) -> dict[str, Any]:
    """The run's record in the checkpoint at ``path``; damage is an error naming the file."""
    file = Path(path) / METADATA
    outer = read_metadata(path)  # the whole metadata checked (validate.py)
    try:
        meta = json.loads(outer["values"][TRAIN_KEY])
    except ValueError as exc:
        raise CheckpointError(f"checkpoint metadata {file} is damaged or unreadable: {exc}") \
            from None
    except (KeyError, TypeError):
        raise CheckpointError(f"checkpoint metadata {file} is damaged or not a training "
                              f"checkpoint: no values.{TRAIN_KEY} record") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint metadata {file} is damaged: the {TRAIN_KEY} record "
                              "is not a JSON object")
    for key, kind in _META_FIELDS.items():
        if key not in meta:
            raise CheckpointError(f"checkpoint metadata {file} is damaged: no {key!r} field")
        if not isinstance(meta[key], kind) or (kind is int and isinstance(meta[key], bool)):
            raise CheckpointError(f"checkpoint metadata {file} is damaged: {key!r} must be "
                                  f"{kind.__name__}, got {meta[key]!r}")
    return meta


def remove_leftovers(directory: str | Path) -> list[Path]:
    """Remove what a crashed save left in ``directory`` (``step_N.tmp`` directories, a replaced
    checkpoint's ``step_N.old-*``, temporary files); the paths removed. Call on one rank, before
    any save."""
    removed = []
    for pattern in ("step_*.tmp", "step_*.old-*"):
        for path in Path(directory).glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in Path(directory).glob(f"{LATEST}.tmp-*"):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints (and always the one ``latest`` names);
    remove the older ones. The paths removed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    steps = sorted(p for p in Path(directory).iterdir()
                   if p.is_dir() and _STEP_DIR.fullmatch(p.name))
    pointer = Path(directory) / LATEST
    try:
        current = _pointer_name(pointer)
    except CheckpointError:
        current = None
    removed = []
    for path in steps[:-keep]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
