"""Translating optimizer state dicts between a rank's local optimizer and the whole optimizer.

A plain optimizer's ``state_dict()`` numbers parameters consecutively over its param groups
(global indices). A rank's local optimizer numbers only its own parameters. Consolidation maps
local numbers to global ones and merges the ranks' states; loading picks this rank's parameters
out of a global state dict and renumbers them, so a state saved at one world size loads at any
other (the partition is recomputed from the parameters, not stored).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise.zero.partition import global_indices

PerGroup = Sequence[Sequence[int]]  # indices within each group that this rank owns


def to_global(local: dict[str, Any], mine: PerGroup, group_lengths: Sequence[int]
              ) -> dict[int, dict[str, Any]]:
    """This rank's local ``state`` re-keyed by global index, tensors moved to the CPU."""
    glob = global_indices(group_lengths)
    mapping = {}
    for g, local_group in enumerate(local["param_groups"]):
        for local_idx, i in zip(local_group["params"], mine[g], strict=True):
            mapping[local_idx] = glob[g][i]
    return {mapping[k]: _detached(v, to_cpu=True) for k, v in local["state"].items()}


def merge(per_rank: Sequence[dict[int, dict[str, Any]]], param_groups: Sequence[dict[str, Any]]
          ) -> dict[str, Any]:
    """The whole state dict from every rank's ``to_global`` output."""
    state: dict[int, dict[str, Any]] = {}
    for part in per_rank:
        state.update(part)
    glob = global_indices([len(g["params"]) for g in param_groups])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": glob[n]}
              for n, g in enumerate(param_groups)]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def to_local(whole: dict[str, Any], mine: PerGroup, params: Sequence[Sequence[torch.Tensor]]
             ) -> dict[str, Any]:
    """The local optimizer's state dict for this rank's parameters, picked out of ``whole``."""
    glob = global_indices([len(p) for p in params])
    state, groups, next_local = {}, [], 0
    for g, saved in enumerate(whole["param_groups"]):
        local_ids = []
        for i in mine[g]:
            entry = whole["state"].get(glob[g][i])
            if entry is not None:
                state[next_local] = _detached(entry, to_cpu=False)
            local_ids.append(next_local)
            next_local += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": local_ids})
    return {"state": state, "param_groups": groups}


def check_fits(whole: Any, params: Sequence[Sequence[torch.Tensor]]) -> None:
    """A clear error unless ``whole`` is an optimizer state dict for exactly these parameters:
    same number of groups, of parameters per group, and state tensors of matching shapes."""
    if not isinstance(whole, dict) or not {"state", "param_groups"} <= whole.keys():
        raise ValueError("not an optimizer state dict: expected a dict with 'state' and "
                         f"'param_groups', got {type(whole).__name__}")
    saved = [len(g["params"]) for g in whole["param_groups"]]
    have = [len(p) for p in params]
    if saved != have:
        raise ValueError(
            f"the state dict is from a different model: its param groups hold {saved} "
            f"parameters, this optimizer's hold {have}"
        )
    flat = [p for group in params for p in group]
    for index, entry in whole["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(flat):
            raise ValueError(f"the state dict is from a different model: it has state for "
                             f"parameter {index!r}, this optimizer has {len(flat)} parameters")
        for key, value in entry.items():
            _check_shape(index, key, value, flat[index])


def _check_shape(index: int, key: str, value: Any, param: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() <= 1 or value.dim() != param.dim():
        return  # scalars (step) and factored states (other shapes by design) are not checked
    if any(a not in (b, 1) for a, b in zip(value.shape, param.shape)):
        raise ValueError(
            f"the state dict is from a different model: state '{key}' of parameter {index} has "
            f"shape {tuple(value.shape)}, the parameter has shape {tuple(param.shape)}"
        )


def _detached(entry: dict[str, Any], to_cpu: bool) -> dict[str, Any]:
    out = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu() if to_cpu else value.detach()
            out[key] = value.clone()
        else:
            out[key] = value
    return out
