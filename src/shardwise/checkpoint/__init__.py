"""Checkpoints: sharded parallel save and load with resharding (torch DCP's names), async save,
export to safetensors; and the training loop's per-rank checkpoints (train_state.py). Every
checkpoint is written under a temporary name and renamed only when complete."""

from shardwise.checkpoint.atomic import atomic_save, atomic_write_text
from shardwise.checkpoint.export import export_safetensors, inspect
from shardwise.checkpoint.loader import load
from shardwise.checkpoint.saver import async_save, save
from shardwise.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
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
    "async_save",
    "atomic_save",
    "atomic_write_text",
    "export_safetensors",
    "get_model_state_dict",
    "get_state_dict",
    "inspect",
    "latest_checkpoint",
    "load",
    "load_rank_state",
    "prune",
    "read_meta",
    "remove_leftovers",
    "save",
    "save_train_state",
    "set_state_dict",
]
