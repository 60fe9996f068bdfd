"""``load``: fill a state dict's own tensors in place from a checkpoint of any layout.

Every rank reads the metadata (checked as a whole first, before any data file is opened or any
buffer allocated: [Note: checkpoint validation] in validate.py), works out the boxes its
destination tensors hold (a plain tensor: the whole tensor; a DTensor: its local box; a
ShardedTensor: its local shards), and for each stored chunk that overlaps one of them reads
only the overlapping rows, block by block, checking each block's CRC-32 (reader.py). So loading
reshards from any saved layout (world size, strategy) to any requested one, and each rank holds
its own share plus one read buffer.
No collective, except one JSON all-gather of the requested keys when ``strict=True``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import boxes, exchange, stateful
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.flatten import Leaf, flatten, is_tensor_like
from shardwise.checkpoint.format import checkpoint_dir
from shardwise.checkpoint.lazy_state import drop_absent_states
from shardwise.checkpoint.reader import BlockReader, blocks_to_read
from shardwise.checkpoint.saver import wait_previous
from shardwise.checkpoint.validate import read_metadata

_SHOW = 20  # names listed in an error


def load(state_dict: dict[str, Any], *, checkpoint_id: str | Path,
         process_group: dist.ProcessGroup | None = None, strict: bool = False,
         no_dist: bool = False) -> None:
    """Load the checkpoint at ``checkpoint_id`` into ``state_dict`` in place. Every requested
    key must be in the checkpoint with the same global shape (else one error lists every
    missing key and every mismatch with both shapes). ``strict=True`` also rejects checkpoint
    keys that no rank requested (collective then: every rank calls it). A top-level
    ``Stateful`` entry is loaded into its ``state_dict()``, which is then handed to its
    ``load_state_dict()`` (stateful.py). ``no_dist=True`` (torch's name): no collective even
    with ``strict``."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    wait_previous()
    root = checkpoint_dir(checkpoint_id)
    process_group = exchange.NO_DIST if no_dist else process_group
    meta = read_metadata(root)
    given, state_dict = state_dict, stateful.expand(state_dict)
    # state that a parameter did not have when saved is absent, not missing: see
    # [Note: optimizer state a parameter does not have yet] in lazy_state.py
    flat = drop_absent_states(state_dict, flatten(state_dict), meta)
    check_request(root, meta, flat, process_group if strict else None, strict)
    reader = BlockReader(root)
    try:
        with torch.no_grad():
            for key, leaf in flat.items():
                if is_tensor_like(leaf.value):
                    _load_tensor(reader, key, meta["tensors"][key], leaf.value)
                else:
                    _set_value(leaf, meta["values"][key])
    finally:
        reader.close()
    stateful.hand_back(given, state_dict)


def check_request(root: Path, meta: dict, flat: dict[str, Leaf], group, strict: bool) -> None:
    tensors, values = meta["tensors"], meta["values"]
    missing, mismatched = [], []
    for key, leaf in flat.items():
        if is_tensor_like(leaf.value):
            if key not in tensors:
                missing.append(key)
            elif list(boxes.global_shape(leaf.value)) != tensors[key]["shape"]:
                mismatched.append(f"{key}: checkpoint {tuple(tensors[key]['shape'])}, "
                                  f"requested {boxes.global_shape(leaf.value)}")
        elif key not in values:
            missing.append(key)
    unexpected = []
    if strict:
        wanted = set()
        for keys in exchange.all_gather_json(sorted(flat), group):
            wanted.update(keys)
        unexpected = sorted((set(tensors) | set(values)) - wanted)
    if missing or mismatched or unexpected:
        raise CheckpointError(f"checkpoint {root} does not fit the state dict: "
                              + "; ".join(_parts(missing, mismatched, unexpected)))


def _parts(missing: list, mismatched: list, unexpected: list) -> list[str]:
    out = []
    if missing:
        out.append(f"missing keys (requested, not in the checkpoint) {_few(missing)}")
    if unexpected:
        out.append(f"unexpected keys (in the checkpoint, not requested) {_few(unexpected)}")
    if mismatched:
        out.append(f"shape mismatches {_few(mismatched)}")
    return out


def _few(names: list[str]) -> str:
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return f"{names[:_SHOW]}{more}"


def _load_tensor(reader: BlockReader, key: str, entry: dict, value: Any) -> None:
    for chunk, rec, _ in reads_of(key, entry, value):
        reader.copy_overlap(key, entry["dtype"], rec, chunk.box, chunk.tensor)


def reads_of(key: str, entry: dict, value: Any) -> Iterator[tuple[boxes.LocalChunk, dict,
                                                                   range]]:
    """The read plan of one destination tensor: for each box it holds, every stored chunk of
    ``entry`` (the metadata's) that overlaps it, with the blocks to read. No I/O."""
    for chunk in boxes.local_chunks(key, value):
        for rec, blocks in reads_for_box(entry, chunk.box):
            yield chunk, rec, blocks


def reads_for_box(entry: dict, box: boxes.Box) -> Iterator[tuple[dict, range]]:
    """Every stored chunk of ``entry`` that overlaps ``box``, with the blocks to read."""
    for rec in entry["chunks"]:
        _, blocks = blocks_to_read(rec, box)
        if blocks:
            yield rec, blocks


def _set_value(leaf: Leaf, saved: Any) -> None:
    if isinstance(leaf.value, tuple) and isinstance(saved, list):
        saved = tuple(saved)
    leaf.container[leaf.slot] = saved
