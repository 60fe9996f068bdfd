"""Nested state dicts as flat ``{dotted key: leaf}`` maps, and writing leaves back in place.

A state dict such as ``{"model": {...}, "optim": {"state": {...}, "param_groups": [...]}}`` is
flattened to keys like ``model.blocks.0.attn.qkv.weight``. Dicts are walked; a list or tuple is
walked only when it holds a tensor somewhere (otherwise it is one JSON value, such as an
optimizer's ``param_groups``). Leaves are tensors (plain, DTensor, ShardedTensor) or JSON values.
Save and load flatten the same way, so only the flat keys need to match. Each leaf also keeps
its path (dict keys and list indices), which the metadata records so that ``format_utils`` can
rebuild the nested state dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.sharded_tensor import ShardedTensor


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor))


@dataclass
class Leaf:
    """One leaf: its value and where it lives (``container[slot]``), to be replaced in place."""

    value: Any
    container: Any  # dict or list holding the value
    slot: Any  # its key or index
    path: tuple = ()  # from the root to the value: see ``step``


def flatten(state: dict[str, Any]) -> dict[str, Leaf]:
    """Every leaf of ``state`` by its dotted key; two paths giving one key is an error."""
    out: dict[str, Leaf] = {}
    for key, leaf in _walk(state, "", ()):
        if key in out:
            raise ValueError(f"state dict: two entries flatten to the same key {key!r}")
        out[key] = leaf
    return out


def _walk(node: Any, prefix: str, path: tuple) -> Iterator[tuple[str, Leaf]]:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise TypeError(f"state dict key {prefix}{k!r}: keys must be str or int")
        key = f"{prefix}{k}"
        here = (*path, step(node, k))
        if isinstance(v, dict) or (isinstance(v, list) and _holds_tensor(v)):
            yield from _walk(v, key + ".", here)
        elif isinstance(v, tuple) and _holds_tensor(v):
            raise TypeError(f"state dict entry {key}: a tuple holding tensors cannot be loaded "
                            "in place; use a list")
        else:
            yield key, Leaf(v, node, k, here)


def step(node: Any, k: str | int) -> str | int | list[int]:
    """One step of a path, as JSON: a dict's str key as itself, a list's index as an int, a
    dict's int key as ``[k]`` (so the three can be told apart when rebuilding)."""
    if isinstance(node, dict) and isinstance(k, int):
        return [k]
    return k


def _holds_tensor(node: Any) -> bool:
    if is_tensor_like(node):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    return False
