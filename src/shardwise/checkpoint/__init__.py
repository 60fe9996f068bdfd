"""Checkpoints: sharded parallel save and load with resharding (torch DCP's names, ``Stateful``
entries included), async save, export to safetensors, one ``torch.save`` file and back
(``format_utils``); and a training run's checkpoints, one per step (train_state.py). Every
checkpoint is written under a temporary name and renamed only when complete; every reader
validates the metadata first (validate.py)."""

from shardwise.checkpoint import format_utils
from shardwise.checkpoint.atomic import atomic_write_text
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
    mark_latest,
    prune,
    read_meta,
    remove_leftovers,
    step_dir,
)

__all__ = [
    "CheckpointError",
    "async_save",
    "atomic_write_text",
    "export_safetensors",
    "format_utils",
    "get_model_state_dict",
    "get_state_dict",
    "inspect",
    "latest_checkpoint",
    "load",
    "mark_latest",
    "prune",
    "read_meta",
    "remove_leftovers",
    "save",
    "set_state_dict",
    "step_dir",
]
