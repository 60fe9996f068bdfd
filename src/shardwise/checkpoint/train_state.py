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
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.atomic import atomic_save, atomic_write_text

LATEST = "latest"


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
    """The newest complete checkpoint in ``directory``; a clear error if there is none."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint to resume from in {directory} (no '{LATEST}' file)")
    path = Path(directory) / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no meta.json)")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def load_rank_state(path: str | Path, rank: int) -> dict[str, Any]:
    """The state saved by ``rank`` (or by rank 0 when the checkpoint is not per rank)."""
    path = Path(path)
    meta = read_meta(path)
    owner = rank if meta["per_rank"] else 0
    file = path / f"rank_{owner:05d}.pt"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no state for rank {owner}")
    return torch.load(file, map_location="cpu", weights_only=False)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
