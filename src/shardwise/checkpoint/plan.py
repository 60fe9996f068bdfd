"""Who writes what: every rank describes the chunks it holds, and the lowest rank holding each
distinct chunk writes it (a replicated tensor is written once, by the lowest rank).

Each rank sends its description (names, global shapes, dtypes, boxes, and its non-tensor values)
to every other rank in one JSON all-gather, so every rank computes the same assignment without a
second round. The gathered plans are also checked: one global shape and dtype per name, and
chunks that tile the tensor exactly.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint import boxes, exchange
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.flatten import Leaf, is_tensor_like
from shardwise.checkpoint.format import dtype_name


@dataclass
class WriteItem:
    name: str
    chunk: boxes.LocalChunk


@dataclass
class SavePlan:
    rank: int
    world: int
    token: str  # rank 0's random id of this save, recorded in the metadata
    items: list[WriteItem]  # the chunks this rank writes
    tensors: dict[str, dict[str, Any]]  # name -> {"shape", "dtype"} over all ranks
    values: dict[str, Any]  # non-tensor values (the lowest rank's)
    paths: dict[str, list]  # every key's path in the nested state dict (flatten.step)


def make_plan(flat: dict[str, Leaf], group: dist.ProcessGroup | None,
              error: str | None = None) -> SavePlan:
    """Collective: one JSON all-gather over ``group``. ``error``: this rank already failed
    (e.g. making the directory); it is raised on every rank, so that no rank waits alone."""
    rank, world = exchange.rank_and_world(group)
    chunks: dict[str, list[boxes.LocalChunk]] = {}
    mine: dict[str, Any] = {"tensors": {}, "values": {}, "token": uuid.uuid4().hex,
                            "error": error, "paths": {k: list(v.path) for k, v in flat.items()}}
    try:
        _describe(flat, chunks, mine)
    except (TypeError, ValueError) as err:
        mine["error"] = mine["error"] or f"{type(err).__name__}: {err}"
    everyone = exchange.all_gather_json(mine, group)
    failed = [(r, p["error"]) for r, p in enumerate(everyone) if p["error"]]
    if failed:
        raise CheckpointError("save failed before writing: " + "; ".join(
            f"rank {r}: {e}" for r, e in failed))
    tensors, writers = _assign(everyone)
    values: dict[str, Any] = {}
    paths: dict[str, list] = {}
    for plan in reversed(everyone):  # the lowest rank's value wins
        values.update(plan["values"])
        paths.update(plan["paths"])
    items = [WriteItem(key, c) for key, cs in chunks.items() for c in cs
             if writers[key][_box_key(c.box)] == rank]
    paths = {k: paths[k] for k in sorted({*tensors, *values})}
    return SavePlan(rank, world, everyone[0]["token"], items, tensors, values, paths)


def _describe(flat: dict[str, Leaf], chunks: dict, mine: dict) -> None:
    for key, leaf in flat.items():
        if is_tensor_like(leaf.value):
            chunks[key] = boxes.local_chunks(key, leaf.value)
            mine["tensors"][key] = {"shape": list(boxes.global_shape(leaf.value)),
                                    "dtype": dtype_name(leaf.value.dtype),
                                    "boxes": [_box_json(c.box) for c in chunks[key]]}
        else:
            mine["values"][key] = _json_value(key, leaf.value)


def _assign(everyone: list[dict]) -> tuple[dict, dict]:
    tensors: dict[str, dict[str, Any]] = {}
    writers: dict[str, dict[tuple, int]] = {}
    for r, plan in enumerate(everyone):
        for key, t in plan["tensors"].items():
            known = tensors.setdefault(key, {"shape": t["shape"], "dtype": t["dtype"]})
            if (known["shape"], known["dtype"]) != (t["shape"], t["dtype"]):
                raise ValueError(f"{key}: ranks disagree on its global shape/dtype: "
                                 f"{known['shape']} {known['dtype']} vs rank {r}'s "
                                 f"{t['shape']} {t['dtype']}")
            for b in t["boxes"]:
                writers.setdefault(key, {}).setdefault(_box_key(b), r)
    for key, t in tensors.items():
        found = [(tuple(o), tuple(s)) for o, s in writers[key]]
        boxes.check_cover(key, t["shape"], found)
    return tensors, writers


def _box_json(box: boxes.Box) -> list[list[int]]:
    return [list(box[0]), list(box[1])]


def _box_key(box) -> tuple:
    return tuple(box[0]), tuple(box[1])


def _json_value(key: str, value: Any) -> Any:
    try:
        text = json.dumps(value, allow_nan=True)
    except TypeError as err:
        raise TypeError(f"state dict entry {key}: {type(value).__name__} is neither a tensor "
                        f"nor a JSON value (int, float, str, bool, None, lists and dicts of "
                        f"them): {err}") from None
    if isinstance(value, float) and not math.isfinite(value):
        return value
    return json.loads(text)
