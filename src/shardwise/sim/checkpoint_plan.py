"""The checkpoint planner at scale: a save at N ranks and its load, resharded, at M ranks,
planned by the checkpoint package's own functions on a dry run's state, without writing data.

[Note: checkpoint dry run]
A real ``save`` has every rank describe the chunks it holds (``checkpoint.plan.describe``),
all-gather the descriptions, and compute alike who writes each distinct chunk
(``plan.assign``, the lowest holder) and what it writes (``plan.items_of``); each rank then
writes its file, whose records (``writer.chunk_record``) rank 0 assembles into the metadata
(``commit.build_metadata``). A load reads, for each box a rank holds, the blocks of every
stored chunk that overlap it (``loader.reads_for_box``). The dry run calls those functions.

What it cannot do is gather: the fake group moves no data, and one process plays one rank. So
the description of every other rank r is made here, from the simulated rank's state dict: a
DTensor's box at r's coordinate of its mesh (``boxes.dtensor_box``, the function the save
itself uses for its own box); a plain tensor held by every rank (replicated: DDP's parameters,
FSDP's step counters), except ZeRO's optimizer state, held by the parameter's owner only
(``ZeroRedundancyOptimizer.owners``), whose shapes and dtypes come from the same optimizer class
stepped over the whole model (fake tensors: no memory). The descriptions are streamed into
``assign`` one rank at a time, so the dry run holds one description, plus the assignment that a
real rank holds too.

The metadata is not built (at 8,192 ranks it holds millions of chunk records): its size is
that of ``build_metadata``'s output with every chunk list empty, plus each record's JSON and
its list separator, records made by ``chunk_record`` in each rank's file order. One record per
chunk shape is serialized (``json.dumps``); the others differ from it only in their integers
(byte offset, box offsets) and file name, whose lengths are added. CRC-32 values
are unknown without data; each is counted at 10 digits (2^32 - 1), so ``metadata_bytes`` is
an upper bound, above the real file by the digits its CRCs lack (tests/sim compare the two with
the CRCs of a real save rewritten as 2^32 - 1: equal). The digest and the token have fixed
lengths.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardwise._compat import DTensor
from shardwise.checkpoint import boxes
from shardwise.checkpoint.commit import build_metadata
from shardwise.checkpoint.flatten import Leaf, flatten, is_tensor_like
from shardwise.checkpoint.format import dtype_from, dtype_name, rank_file
from shardwise.checkpoint.loader import reads_for_box
from shardwise.checkpoint.plan import SavePlan, assign, describe, items_of
from shardwise.checkpoint.reader import block_bytes
from shardwise.checkpoint.state_dict import ensure_state, get_state_dict, param_names
from shardwise.checkpoint.writer import block_starts, chunk_record
from shardwise.sim.fake_group import SimulationError, fake_tensors, fake_world
from shardwise.zero import ZeroRedundancyOptimizer

CRC_BOUND = 2**32 - 1  # each unknown CRC-32 counted at its widest (10 digits)


@dataclass(frozen=True)
class Reshard:
    """Load the saved checkpoint at ``world_size`` ranks, as rank ``rank`` of them."""

    world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise SimulationError(f"--reshard-to must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise SimulationError(f"--rank {self.rank} is outside the --reshard-to world of "
                                  f"{self.world_size} ranks (0 to {self.world_size - 1})")


def checkpoint_state(wrapped: Any) -> dict[str, Any]:
    """What the dry run saves: ``{"model": ..., "optim": ...}`` of ``get_state_dict``, as
    `shardwise train` saves a strategy's training state (without its JSON run record)."""
    model_sd, optim_sd = get_state_dict(wrapped.model, wrapped.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def target_boxes(build: Callable[[], nn.Module], run: Any) -> dict[str, tuple[str, list]]:
    """The load side: ``run``'s strategy wrapped on rank ``run.rank`` of ``run.world_size``
    (the fake group), its optimizer state created as ``get_state_dict`` does (one step at
    learning rate 0, no forward), and the boxes its state dict holds per key (with the dtype)."""
    from shardwise.sim import step

    with fake_world(run.world_size, run.rank) as world:
        meshes = step._meshes(run, world)
        model = build().to(step.DTYPES[run.precision])
        with fake_tensors():
            model.to_empty(device="cpu")
            wrapped = step.WRAPPERS[run.strategy](model, run, world, meshes)
            flat = flatten(checkpoint_state(wrapped))
        # outside the fake mode: torch computes a DTensor's box with small real tensors
        return {key: (dtype_name(leaf.value.dtype),
                      [c.box for c in boxes.local_chunks(key, leaf.value)])
                for key, leaf in flat.items() if is_tensor_like(leaf.value)}


def plan_checkpoint(wrapped: Any, run: Any, target: dict[str, tuple[str, list]] | None,
                    reshard: Reshard | None) -> dict[str, Any]:
    """Inside the fake world of ``run`` (the save side, after the dry run's step): the save's
    plan and figures, and the reads of the load's rank (``target``, from ``target_boxes``)."""
    start = time.process_time()
    state = checkpoint_state(wrapped)
    flat = flatten(state)
    chunks, mine = describe(flat)
    if mine["error"]:
        raise SimulationError(f"the checkpoint cannot be planned: {mine['error']}")
    full, holder = _all_ranks_state(wrapped, state, flat)
    done = assign(_descriptions(full, holder, mine, run.world_size))
    own = items_of(chunks, done.writers, run.rank)
    save, reads = _save_figures(done, run.world_size, target)
    save["rank"] = {"rank": run.rank, "chunks_held": sum(len(c) for c in chunks.values()),
                    "chunks_written": len(own),
                    "bytes_written": sum(boxes.numel(i.chunk.box[1]) * i.chunk.tensor.itemsize
                                         for i in own)}
    out: dict[str, Any] = {"save": save, "load": None}
    if reshard is not None:
        out["load"] = {"world_size": reshard.world_size, "rank": reshard.rank, **reads}
    out["cpu_seconds"] = round(time.process_time() - start, 3)
    return out


# -- every rank's description --------------------------------------------------------------


def _all_ranks_state(wrapped: Any, state: dict[str, Any], flat: dict[str, Leaf]
                     ) -> tuple[dict[str, Leaf], dict[str, int]]:
    """The flat state dict holding every key some rank holds, and the owner of each key held
    by one rank only (ZeRO's optimizer state); every other key is held by every rank."""
    opt = wrapped.optimizer
    if not isinstance(opt, ZeroRedundancyOptimizer):
        return flat, {}
    names = param_names(wrapped.model)
    owners = {names[id(p)]: r for p, r in opt.owners().items()}
    whole = _whole_optimizer(opt)
    every = {names[id(p)]: dict(whole.state[c])
             for p, c in zip(_params(opt), _params(whole)) if whole.state.get(c)}
    full = flatten({"model": state["model"],
                    "optim": {"state": every, "param_groups": state["optim"]["param_groups"]}})
    holder = {k: owners[leaf.path[2]] for k, leaf in full.items()
              if leaf.path[:2] == ("optim", "state") and is_tensor_like(leaf.value)}
    return full, holder


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _whole_optimizer(opt: ZeroRedundancyOptimizer) -> torch.optim.Optimizer:
    """ZeRO's optimizer class over stand-ins of every parameter, its state created as
    ``get_state_dict`` creates it: the state each parameter's owner holds."""
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [torch.empty_like(p).requires_grad_(p.requires_grad)
                          for p in g["params"]]} for g in opt.param_groups]
    whole = opt.optimizer_class(groups)
    ensure_state(whole)
    return whole


def _descriptions(full: dict[str, Leaf], holder: dict[str, int], mine: dict,
                  world: int) -> Iterator[dict]:
    """Every rank's description, in rank order, one at a time (see [Note: checkpoint dry
    run]); non-tensor values and paths as the simulated rank's."""
    cache: dict[tuple, list] = {}
    layouts = {key: _layout(key, leaf.value, world, cache) for key, leaf in full.items()
               if is_tensor_like(leaf.value)}
    paths = {k: list(v.path) for k, v in full.items() if k not in holder}
    owned: list[list[str]] = [[] for _ in range(world)]
    for key, r in holder.items():
        owned[r].append(key)
    for r in range(world):
        tensors = {}
        for key, (shape, dtype, box_at) in layouts.items():
            if holder.get(key, r) == r:
                tensors[key] = {"shape": shape, "dtype": dtype, "boxes": [box_at(r)]}
        mine_r = paths if not owned[r] else {**paths, **{k: list(full[k].path)
                                                          for k in owned[r]}}
        yield {"tensors": tensors, "values": mine["values"], "token": mine["token"],
               "error": None, "paths": mine_r}


def _layout(key: str, value: Any, world: int, cache: dict
            ) -> tuple[list[int], str, Callable]:
    shape, dtype = list(boxes.global_shape(value)), dtype_name(value.dtype)
    if isinstance(value, DTensor):
        return shape, dtype, _dtensor_boxes(key, value, world, cache)
    if is_tensor_like(value) and not isinstance(value, torch.Tensor):
        raise SimulationError(f"{key}: a ShardedTensor's checkpoint is not simulated")
    whole = ((0,) * len(shape), tuple(shape))
    return shape, dtype, lambda r: whole


def _dtensor_boxes(key: str, value: DTensor, world: int, cache: dict
                   ) -> Callable[[int], tuple]:
    """Rank -> the box it holds of ``value`` (one box per rank, computed once per layout:
    ``cache`` maps (shape, mesh shape, placements) to every rank's box)."""
    mesh = value.device_mesh
    table = mesh.mesh
    if table.numel() != world or mesh.size() != world:
        raise SimulationError(f"{key}: a DTensor on a mesh of {mesh.size()} of the {world} "
                              "ranks; the checkpoint dry run needs meshes of the whole world")
    cache_key = (tuple(value.shape), tuple(mesh.shape), tuple(value.placements))
    if cache_key not in cache:
        coords: list = [None] * world
        for index, r in enumerate(table.reshape(-1).tolist()):
            coords[r] = _unravel(index, tuple(mesh.shape))
        cache[cache_key] = [boxes.dtensor_box(value.shape, mesh.shape, c, value.placements)
                            for c in coords]
    return cache[cache_key].__getitem__


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return out[::-1]


# -- the metadata's size and the load's reads -------------------------------------------------


def _save_figures(done: Any, world: int, target: dict | None) -> tuple[dict, dict]:
    """The chunk records every rank's file would hold, in file order, streamed: their count,
    the metadata's bytes, the data bytes; and the target rank's reads of them."""
    offset = [0] * world  # bytes written so far into each rank's file
    plan = SavePlan(0, world, done.token, [], done.tensors, done.values, done.paths)
    skeleton = build_metadata(plan, [{"file": rank_file(r), "size": 0, "chunks": []}
                                     for r in range(world)])
    name_extra = [len(rank_file(r)) - len(rank_file(0)) for r in range(world)]
    templates: dict[tuple, tuple[int, int, int]] = {}
    chunk_bytes, n_chunks = 0, 0
    reads = {"chunks_read": 0, "blocks_read": 0, "bytes_read": 0}
    for key, t in done.tensors.items():
        itemsize = dtype_from(t["dtype"]).itemsize
        records = []
        for (offsets, sizes), r in done.writers[key].items():
            length, nbytes, k = templates.get((sizes, itemsize)) or _template(
                templates, key, sizes, itemsize)
            # the record's JSON differs from its template's only in these ints and the name
            chunk_bytes += (length + 2 + len(str(offset[r])) - 1 + name_extra[r]
                            + sum(len(str(o)) - 1 for o in offsets))  # ", " between records
            offset[r] += nbytes
            if target is not None:
                records.append({"offsets": offsets, "sizes": sizes, "block_rows": k})
        chunk_bytes -= 2
        n_chunks += len(done.writers[key])
        if target is not None and key in target:
            _count_reads(reads, {"chunks": records}, target[key][1], itemsize)
    skeleton["files"] = {rank_file(r): offset[r] for r in range(world)}
    size = len(json.dumps(skeleton, allow_nan=True)) + chunk_bytes
    save = {"world_size": world, "metadata_bytes": size, "chunks": n_chunks,
            "tensors": len(done.tensors), "files": world, "data_bytes": sum(offset)}
    return save, reads


def _template(templates: dict, key: str, sizes: tuple, itemsize: int) -> tuple[int, int, int]:
    """A chunk of ``sizes`` at offset 0 of rank 0's file, as ``chunk_record`` makes it and
    ``build_metadata`` stores it (no name): its JSON length, its bytes, its block rows."""
    rec = chunk_record(key, rank_file(0), 0, (0,) * len(sizes), sizes, itemsize,
                       [CRC_BOUND] * len(block_starts(sizes, itemsize)))
    del rec["name"]
    templates[sizes, itemsize] = found = (len(json.dumps(rec, allow_nan=True)), rec["nbytes"],
                                          rec["block_rows"])
    return found


def _count_reads(reads: dict, entry: dict, wanted: list, itemsize: int) -> None:
    for box in wanted:
        for rec, blocks in reads_for_box(entry, box):
            reads["chunks_read"] += 1
            reads["blocks_read"] += len(blocks)
            reads["bytes_read"] += sum(block_bytes(rec, itemsize, b) for b in blocks)


def simulate_checkpoint(build: Callable[[], nn.Module], run: Any,
                        reshard: Reshard | None) -> Callable[[Any], dict]:
    """The ``after`` hook of ``step.simulate_step`` for ``run``: the load side is dry-run
    first (its own fake world), then the hook plans the save in ``run``'s world."""
    target = None
    if reshard is not None:
        target = target_boxes(build, replace(run, world_size=reshard.world_size,
                                             rank=reshard.rank))
    return lambda wrapped: {"checkpoint": plan_checkpoint(wrapped, run, target, reshard)}


def format_checkpoint(plan: dict) -> list[str]:
    """The table's lines for one row's checkpoint plan."""
    save, load = plan["save"], plan["load"]
    mine = save["rank"]
    lines = [f"    checkpoint saved at {save['world_size']} ranks: metadata "
             f"{_size(save['metadata_bytes'])} (at most), {save['chunks']:,} chunks of "
             f"{save['tensors']:,} tensors in {save['files']:,} files, "
             f"{_size(save['data_bytes'])} of data; rank {mine['rank']} holds "
             f"{mine['chunks_held']:,} chunks, writes {mine['chunks_written']:,} "
             f"({_size(mine['bytes_written'])})"]
    if load is not None:
        lines.append(f"    loaded at {load['world_size']} ranks: rank {load['rank']} reads "
                     f"{load['chunks_read']:,} chunks ({load['blocks_read']:,} blocks, "
                     f"{_size(load['bytes_read'])}); planned in {plan['cpu_seconds']:.2f} s "
                     "of CPU")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


__all__ = ["CRC_BOUND", "Reshard", "checkpoint_state", "format_checkpoint", "plan_checkpoint",
           "simulate_checkpoint", "target_boxes"]
