"""Optimizer state that a checkpoint holds for some parameters only.

[Note: optimizer state a parameter does not have yet]
torch's optimizers make a parameter's state at its first step with a gradient, so a parameter
that never got one (a pooler the loss does not reach yet, an expert no token picked) has none,
and a checkpoint of the run has none for it. The state dict that a load fills usually comes from
a new optimizer whose state ``get_state_dict`` made for every parameter, so those entries would
be missing keys and the resume would fail, as it does with torch's DCP. So a requested entry
``<optim>.state.<param>.<name>`` counts as absent by design, not as missing, when the checkpoint
holds nothing at all under ``<optim>.state.<param>.`` and its ``<optim>.param_groups`` list
that parameter: the parameter's whole entry leaves the requested state dict, and
``set_state_dict`` then removes the optimizer's state for it (checkpoint/state_dict.py), so its
state is made at its first step, as in the run that saved. A parameter with part of its state
in the checkpoint, or one the checkpoint's groups do not list, is still a missing key.
tests/checkpoint/test_lazy_optimizer_state.py.
"""

from __future__ import annotations

import bisect
from typing import Any

from shardwise.checkpoint.flatten import Leaf


def drop_absent_states(state_dict: dict[str, Any], flat: dict[str, Leaf],
                       meta: dict[str, Any]) -> dict[str, Leaf]:
    """Remove from ``state_dict`` (nested) and ``flat`` (its leaves) the optimizer state of
    each parameter that the checkpoint ``meta`` has none of by design (see the Note)."""
    stored = sorted(set(meta["tensors"]) | set(meta["values"]))
    dropped: set[str] = set()
    for key, leaf in flat.items():
        owner = _absent_owner(key, leaf, stored, meta)
        if owner is not None and owner not in dropped:
            dropped.add(owner)
            _remove(state_dict, leaf.path[:-1])
    if not dropped:
        return flat
    return {k: v for k, v in flat.items() if not any(k.startswith(d + ".") for d in dropped)}


def _absent_owner(key: str, leaf: Leaf, stored: list[str], meta: dict) -> str | None:
    """``<optim>.state.<param>`` when ``key`` is that parameter's state and the checkpoint has
    none of it while its groups list the parameter; else None."""
    if key in meta["tensors"] or key in meta["values"]:
        return None
    if len(leaf.path) < 3 or leaf.path[-3] != "state":
        return None
    param = leaf.path[-2]
    param = param[0] if isinstance(param, list) else param  # an int key: [k]
    owner = key[: -len(str(leaf.slot)) - 1]
    if _has_prefix(stored, owner + "."):
        return None  # part of its state is there: a missing key, not an absent state
    optim = owner[: -len(str(param))].removesuffix("state.")  # "<optim>." or ""
    groups = meta["values"].get(optim + "param_groups")
    if not isinstance(groups, list):
        return None
    listed = any(isinstance(g, dict) and param in g.get("params", ()) for g in groups)
    return owner if listed else None


def _has_prefix(stored: list[str], prefix: str) -> bool:
    at = bisect.bisect_left(stored, prefix)
    return at < len(stored) and stored[at].startswith(prefix)


def _remove(root: dict[str, Any], path: tuple) -> None:
    """Delete the entry at ``path`` (dict keys; an int key as ``[k]``) from ``root``."""
    node: Any = root
    for step in path[:-1]:
        node = node[step[0] if isinstance(step, list) else step]
    last = path[-1]
    del node[last[0] if isinstance(last, list) else last]
