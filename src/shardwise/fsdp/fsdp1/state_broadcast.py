"""Sending rank 0's name-keyed optimizer state dict to every rank, without pickle.

Used where torch's FSDP1 lets only rank 0 hold the full optimizer state when loading
(``FullOptimStateDictConfig(rank0_only=True)``, ``scatter_full_optim_state_dict``). Nothing that
arrives may run code, so the structure travels as JSON (names, state keys, tensor shapes and
dtypes, scalar values, param-group hyperparameters) in one broadcast of its bytes, followed by
one broadcast per tensor into a buffer of the announced shape and dtype. Dtypes are looked up by
name among torch's dtypes only.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from shardwise._compat import DTensor
from shardwise.distributed.collectives import broadcast_bytes
from shardwise.distributed.groups import global_rank
from shardwise.fsdp.collectives import broadcast_from


def broadcast_named_state(osd: dict[str, Any] | None, group: dist.ProcessGroup | None,
                          device: torch.device) -> dict[str, Any]:
    """Rank 0 (of ``group``) passes its state dict; every rank returns a copy of it.
    Collective over ``group``; ``device`` is where the tensors travel (CPU for gloo)."""
    src = global_rank(group, 0)
    is_src = dist.get_rank(group) == 0
    meta = json.loads(broadcast_bytes(json.dumps(_describe(osd)).encode() if is_src else None,
                                      0, group))
    tensors = _tensors(osd) if is_src else []
    state: dict[str, Any] = {}
    at = 0
    for name, entry in meta["state"].items():
        state[name] = {}
        for key, info in entry.items():
            if "tensor" not in info:
                state[name][key] = info["value"]
                continue
            buf = (tensors[at].detach().to(device).contiguous() if is_src else
                   torch.empty(info["tensor"], dtype=_dtype(info["dtype"]), device=device))
            at += 1
            broadcast_from(buf, src, group)
            state[name][key] = buf
    return {"state": state, "param_groups": meta["param_groups"]}


def _describe(osd: dict[str, Any] | None) -> dict[str, Any]:
    if not osd or "state" not in osd or "param_groups" not in osd:
        raise ValueError("rank 0 must pass the full optimizer state dict ('state' and "
                         "'param_groups')")
    state = {}
    for name, entry in osd["state"].items():
        state[name] = {}
        for key, value in entry.items():
            if isinstance(value, DTensor):
                raise ValueError(f"optimizer state {name}.{key} is a DTensor: rank 0 must pass "
                                 "a full state dict (FULL_STATE_DICT)")
            if isinstance(value, torch.Tensor):
                state[name][key] = {"tensor": list(value.shape),
                                    "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                state[name][key] = {"value": _plain(value, f"{name}.{key}")}
    groups = [{k: _plain(v, k) for k, v in g.items()} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _tensors(osd: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for entry in osd["state"].values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def _plain(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        raise TypeError(f"optimizer state entry {what} ({type(value).__name__}) cannot be sent "
                        "between ranks: only tensors and JSON values can") from None
    return value


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a broadcast optimizer state")
    return dtype


def restore_tuples(osd: dict[str, Any], optim: torch.optim.Optimizer) -> dict[str, Any]:
    """JSON turned tuples (e.g. Adam's ``betas``) into lists: make them tuples again where the
    optimizer's own group holds a tuple."""
    for saved, own in zip(osd["param_groups"], optim.param_groups):
        for key, value in saved.items():
            if isinstance(own.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
    return osd
