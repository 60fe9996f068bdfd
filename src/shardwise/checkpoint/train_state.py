"""A training checkpoint: a directory per saved step, made visible only once complete.

Layout under the checkpoint directory::

    step_000200/meta.json        what wrote it (model config, strategy, world size, step)
    step_000200/rank_00000.pt    the state of rank 0 (and of every rank when states are sharded)
    latest                       the name of the newest complete step directory

Every rank writes into ``step_N.tmp`` and waits at a barrier; rank 0 then writes ``meta.json``
and renames the directory, and only then points ``latest`` at it. A crash at any moment leaves
the previous checkpoint intact and ``latest`` pointing at it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.atomic import atomic_save, atomic_write_text

LATEST = "latest"
_STEP_DIR = re.compile(r"step_\d+")
# meta.json's required fields and their types
_META_FIELDS = {"model": dict, "strategy": str, "world_size": int, "step": int, "per_rank": bool}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit this run."""


def save_train_state(directory: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any],
                     per_rank: bool, group: dist.ProcessGroup | None = None) -> Path:
    """Save this rank's ``state`` (every rank if ``per_rank``, else rank 0 only) for ``step``.

    Collective: two barriers over ``group``, so every rank must call it.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    final = Path(directory) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    if per_rank or rank == 0:
        atomic_save(state, tmp / f"rank_{rank:05d}.pt")
    _barrier(group)
    if rank == 0:
        atomic_write_text(json.dumps({**meta, "step": step, "per_rank": per_rank}, indent=2),
                          tmp / "meta.json")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        atomic_write_text(final.name, Path(directory) / LATEST)
    _barrier(group)
    return final


def latest_checkpoint(directory: str | Path) -> Path:
    """The newest complete checkpoint in ``directory``; a clear error if there is none.

    ``latest`` may only name a ``step_N`` directory directly inside ``directory``: a pointer to
    anywhere else (``../other/step_000040``, an absolute path) is refused, so that a resume never
    loads state from outside the checkpoint directory.
    """
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint to resume from in {directory} (no '{LATEST}' file)")
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {pointer}: {exc}") from None
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory "
                              f"inside {directory} (expected step_NNNNNN)")
    path = Path(directory) / name
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no meta.json)")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path``; a damaged one is an error naming the file."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata {file} is damaged or unreadable: {exc}") \
            from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint metadata {file} is damaged: not a JSON object")
    for key, kind in _META_FIELDS.items():
        if key not in meta:
            raise CheckpointError(f"checkpoint metadata {file} is damaged: no {key!r} field")
        if not isinstance(meta[key], kind) or (kind is int and isinstance(meta[key], bool)):
            raise CheckpointError(f"checkpoint metadata {file} is damaged: {key!r} must be "
                                  f"{kind.__name__}, got {meta[key]!r}")
    return meta


def remove_leftovers(directory: str | Path) -> list[Path]:
    """Remove what a crashed save left in ``directory`` (``step_N.tmp`` directories, temporary
    files); the paths removed. Call on one rank, before any save."""
    removed = []
    for path in Path(directory).glob("step_*.tmp"):
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
    current = pointer.read_text().strip() if pointer.is_file() else None
    removed = []
    for path in steps[:-keep]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def load_rank_state(path: str | Path, rank: int) -> dict[str, Any]:
    """The state saved by ``rank`` (or by rank 0 when the checkpoint is not per rank)."""
    path = Path(path)
    meta = read_meta(path)
    owner = rank if meta["per_rank"] else 0
    file = path / f"rank_{owner:05d}.pt"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no state for rank {owner}")
    try:
        with torch.serialization.safe_globals(_state_classes()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors have no common base class
        raise CheckpointError(f"cannot load {file}: {type(exc).__name__}: {exc}") from None


def _state_classes() -> list[type]:
    """The only classes a rank state may hold besides tensors and plain containers: those of a
    tensor-parallel state (sharded tensors and their metadata). Anything else is refused."""
    from shardwise.sharded_tensor.metadata import (
        Placement,
        ShardedTensorMetadata,
        ShardMetadata,
        TensorProperties,
    )
    from shardwise.sharded_tensor.shard import Shard
    from shardwise.sharded_tensor.sharded_tensor import ShardedTensor
    from shardwise.sharded_tensor.spec import ChunkShardingSpec, EnumerableShardingSpec

    return [ShardedTensor, ShardedTensorMetadata, Shard, ShardMetadata, TensorProperties,
            Placement, ChunkShardingSpec, EnumerableShardingSpec]


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
