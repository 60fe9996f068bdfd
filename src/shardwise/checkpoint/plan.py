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
from collections.abc import Iterable
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


@dataclass
class Assignment:
    """The coordinator's part of a save plan, which every rank computes alike from every
    rank's description: each tensor's global shape and dtype, the writer of each distinct
    chunk (``writers[name][box key]``: the lowest rank holding it), the non-tensor values and
    the paths (the lowest rank's), and the save's token (rank 0's)."""

    tensors: dict[str, dict[str, Any]]
    writers: dict[str, dict[tuple, int]]
    values: dict[str, Any]
    paths: dict[str, list]
    token: str


def make_plan(flat: dict[str, Leaf], group: dist.ProcessGroup | None,
              error: str | None = None) -> SavePlan:
    """Collective: one JSON all-gather over ``group``. ``error``: this rank already failed
    (e.g. making the directory); it is raised on every rank, so that no rank waits alone."""
    rank, world = exchange.rank_and_world(group)
    chunks, mine = describe(flat, error)
    everyone = exchange.all_gather_json(mine, group)
    failed = [(r, p["error"]) for r, p in enumerate(everyone) if p["error"]]
    if failed:
        raise CheckpointError("save failed before writing: " + "; ".join(
            f"rank {r}: {e}" for r, e in failed))
    done = assign(everyone)
    return SavePlan(rank, world, done.token, items_of(chunks, done.writers, rank),
                    done.tensors, done.values, done.paths)


def describe(flat: dict[str, Leaf], error: str | None = None
             ) -> tuple[dict[str, list[boxes.LocalChunk]], dict[str, Any]]:
    """This rank's chunks and its description (what it all-gathers): every tensor's global
    shape, dtype and the boxes it holds, its non-tensor values, every key's path, a random
    token and its error (None, or why it failed). No collective."""
    chunks: dict[str, list[boxes.LocalChunk]] = {}
    mine: dict[str, Any] = {"tensors": {}, "values": {}, "token": uuid.uuid4().hex,
                            "error": error, "paths": {k: list(v.path) for k, v in flat.items()}}
    try:
        _describe(flat, chunks, mine)
    except (TypeError, ValueError) as err:
        mine["error"] = mine["error"] or f"{type(err).__name__}: {err}"
    return chunks, mine


def items_of(chunks: dict[str, list[boxes.LocalChunk]], writers: dict[str, dict[tuple, int]],
             rank: int) -> list[WriteItem]:
    """The chunks ``rank`` writes (those it is the lowest holder of), in its state dict's
    order: the order of its data file."""
    return [WriteItem(key, c) for key, cs in chunks.items() for c in cs
            if writers[key][_box_key(c.box)] == rank]


def _describe(flat: dict[str, Leaf], chunks: dict, mine: dict) -> None:
    for key, leaf in flat.items():
        if is_tensor_like(leaf.value):
            chunks[key] = boxes.local_chunks(key, leaf.value)
            mine["tensors"][key] = {"shape": list(boxes.global_shape(leaf.value)),
                                    "dtype": dtype_name(leaf.value.dtype),
                                    "boxes": [_box_json(c.box) for c in chunks[key]]}
        else:
            mine["values"][key] = _json_value(key, leaf.value)


def assign(everyone: Iterable[dict]) -> Assignment:
    """Every rank's description (in rank order; a list, or an iterable read once) -> the
    assignment. One pass over the descriptions, then one tiling check per tensor: linear in
    the number of chunks. ValueError when ranks disagree on a tensor's shape or dtype, or
    their chunks do not tile it."""
    tensors: dict[str, dict[str, Any]] = {}
    writers: dict[str, dict[tuple, int]] = {}
    values: dict[str, Any] = {}
    paths: dict[str, list] = {}
    token = None
    for r, plan in enumerate(everyone):
        token = plan["token"] if token is None else token
        for key, t in plan["tensors"].items():
            known = tensors.get(key)
            if known is None:
                known = tensors[key] = {"shape": t["shape"], "dtype": t["dtype"]}
            elif (known["shape"], known["dtype"]) != (t["shape"], t["dtype"]):
                raise ValueError(f"{key}: ranks disagree on its global shape/dtype: "
                                 f"{known['shape']} {known['dtype']} vs rank {r}'s "
                                 f"{t['shape']} {t['dtype']}")
            held = writers.setdefault(key, {})
            for b in t["boxes"]:
                held.setdefault(_box_key(b), r)
        for key, value in plan["values"].items():  # the lowest rank's value wins
            values.setdefault(key, value)
        for key, path in plan["paths"].items():
            paths.setdefault(key, path)
    for key, t in tensors.items():
        found = [(tuple(o), tuple(s)) for o, s in writers[key]]
        boxes.check_cover(key, t["shape"], found)
    paths = {k: paths[k] for k in sorted({*tensors, *values})}
    return Assignment(tensors, writers, values, paths, token or "")


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
