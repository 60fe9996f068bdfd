"""Checkpoints: written to a temporary name and renamed only when complete."""

from shardwise.checkpoint.atomic import atomic_save, atomic_write_text
from shardwise.checkpoint.train_state import (
    CheckpointError,
    latest_checkpoint,
    load_rank_state,
    prune,
    read_meta,
    remove_leftovers,
    save_train_state,
)

__all__ = [
    "CheckpointError",
    "atomic_save",
    "atomic_write_text",
    "latest_checkpoint",
    "load_rank_state",
    "prune",
    "read_meta",
    "remove_leftovers",
    "save_train_state",
]
