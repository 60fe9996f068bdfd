"""One file for a single-process user and back: torch's ``format_utils`` names, our format.

``dcp_to_torch_save(dcp_checkpoint_dir, torch_save_path)`` reads a sharded checkpoint into one
nested state dict of whole tensors (the nesting rebuilt from the paths the metadata records)
and ``torch.save``s it; ``torch_save_to_dcp(torch_save_path, dcp_checkpoint_dir)`` reads a
``torch.save`` file with ``weights_only=True`` (tensors and plain containers only: nothing in
it runs code) and saves it as a checkpoint. Both work in this process alone, with no
collective, even inside a distributed job (torch DCP's ``no_dist=True``). As in torch,
``dcp_to_torch_save`` holds the whole state in memory; the checkpoint's metadata is validated
first (validate.py), so no more is allocated than its files hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.atomic import create_exclusive, temp_name
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.exchange import NO_DIST
from shardwise.checkpoint.format import dtype_from
from shardwise.checkpoint.loader import load
from shardwise.checkpoint.safe_open import open_regular
from shardwise.checkpoint.saver import save
from shardwise.checkpoint.validate import read_metadata

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike,
                      torch_save_path: str | os.PathLike) -> None:
    """Write the checkpoint at ``dcp_checkpoint_dir`` as one ``torch.save`` file: its state
    dict nested as it was saved, every tensor whole (DTensors and ShardedTensors assembled
    into plain CPU tensors), values as JSON gave them back (a tuple as a list). Written to a
    new temporary file beside ``torch_save_path`` and renamed."""
    meta = read_metadata(dcp_checkpoint_dir)
    state = _skeleton(meta)
    load(state, checkpoint_id=dcp_checkpoint_dir, process_group=NO_DIST, strict=True)
    out = Path(torch_save_path)
    tmp = temp_name(out)
    try:
        with create_exclusive(tmp) as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def torch_save_to_dcp(torch_save_path: str | os.PathLike,
                      dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Save the state dict in the ``torch.save`` file ``torch_save_path`` (loaded with
    ``weights_only=True``, onto the CPU) as a checkpoint at ``dcp_checkpoint_dir``. The file
    is opened as a checkpoint's files are (safe_open.py: a FIFO or link there is refused)."""
    try:
        with open_regular(torch_save_path, "torch.save file") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no torch.save file at {torch_save_path}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{torch_save_path} holds a {type(state).__name__}, not a state "
                              "dict")
    save(state, checkpoint_id=dcp_checkpoint_dir, process_group=NO_DIST)


def _skeleton(meta: dict[str, Any]) -> dict[str, Any]:
    """The nested state dict the metadata describes: an empty tensor of each global shape and
    dtype, each value as stored."""
    root: dict[str, Any] = {}
    for key, path in meta["paths"].items():
        if key in meta["tensors"]:
            t = meta["tensors"][key]
            leaf = torch.empty(t["shape"], dtype=dtype_from(t["dtype"]))
        else:
            leaf = meta["values"][key]
        node = root
        for here, nxt in zip(path, path[1:]):
            node = _child(node, here, [] if isinstance(nxt, int) else {})
        _put(node, path[-1], leaf)
    return root


_GAP = 1024  # list entries that may be missing (an empty dict saved in a list has no key)


def _slot(node: Any, step: Any) -> Any:
    """Where ``step`` goes in ``node``: a list grown to hold the index, or a dict's key."""
    if isinstance(node, list) != (isinstance(step, int) and not isinstance(step, bool)):
        raise CheckpointError(f"checkpoint metadata: the paths disagree on whether a container "
                              f"is a list or a dict (step {step!r})")
    if isinstance(node, list):
        if step > len(node) + _GAP:
            raise CheckpointError(f"checkpoint metadata: list index {step} leaves too large a "
                                  "gap")
        node.extend([None] * (step + 1 - len(node)))
        return step
    return step[0] if isinstance(step, list) else step  # [k]: a dict's int key


def _child(node: Any, step: Any, fresh: Any) -> Any:
    slot = _slot(node, step)
    if node[slot] is None if isinstance(node, list) else slot not in node:
        node[slot] = fresh
    if not isinstance(node[slot], (list, dict)):
        raise CheckpointError(f"checkpoint metadata: a path goes through the value at {step!r}")
    return node[slot]


def _put(node: Any, step: Any, leaf: Any) -> None:
    node[_slot(node, step)] = leaf
