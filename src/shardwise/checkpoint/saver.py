"""``save`` and ``async_save``: every rank writes the chunks it owns, in parallel, one file each.

``save`` (collective over ``process_group``): rank 0 makes ``<id>.tmp``; one JSON all-gather
exchanges the ranks' plans (who holds which chunks; the lowest holder writes each, see plan.py);
each rank writes and fsyncs its file and a part file; a JSON all-gather of every rank's outcome
(so a failure on one rank is raised on all); rank 0 commits (commit.py); a last all-gather
carries rank 0's outcome to everyone. ``async_save`` runs the plan exchange and a copy of this
rank's share to CPU memory in the caller's thread (the stall), then writes and commits in a
background thread with no collective (ranks meet through the part files).

Both take ``_fault_hook`` for the tests that break a save at a chosen point: called as
``hook(point, index)`` at the points of the write and the commit (a hook that raises or exits
stands for a failing disk or a killed process); None, as always outside tests, calls nothing.
"""

from __future__ import annotations

import shutil
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint import commit as commit_mod
from shardwise.checkpoint import exchange, stateful
from shardwise.checkpoint.boxes import LocalChunk
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.flatten import flatten
from shardwise.checkpoint.format import checkpoint_dir, rank_file, tmp_dir
from shardwise.checkpoint.plan import SavePlan, WriteItem, make_plan
from shardwise.checkpoint.validate import read_metadata
from shardwise.checkpoint.writer import write_file

FaultHook = Callable[[str, int], None]  # tests only: see the module docstring
ASYNC_COMMIT_TIMEOUT_S = 1800.0
_pending: list[Future] = []  # the previous async save of this process, if any


def save(state_dict: dict[str, Any], *, checkpoint_id: str | Path,
         process_group: dist.ProcessGroup | None = None, no_dist: bool = False,
         _fault_hook: FaultHook | None = None) -> dict[str, Any]:
    """Save ``state_dict`` (tensors, DTensors, ShardedTensors, JSON values, nested; a
    top-level ``Stateful`` entry as its ``state_dict()``, see stateful.py) into the directory
    ``checkpoint_id``; returns the metadata. Collective: every rank calls it (with
    ``no_dist=True``, as in torch, this process saves alone: no collective)."""
    wait_previous()
    process_group = exchange.NO_DIST if no_dist else process_group
    final, tmp, plan = _prepare(state_dict, checkpoint_id, process_group)
    error = _try(lambda: _write(tmp, plan, _fault_hook))
    _raise_any(exchange.all_gather_json(error, process_group), "writing")
    error = None
    if plan.rank == 0:
        error = _try(lambda: _commit_now(tmp, final, plan, _fault_hook))
    _raise_any(exchange.all_gather_json(error, process_group), "committing")
    return read_metadata(final)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | Path,
               process_group: dist.ProcessGroup | None = None, no_dist: bool = False,
               _fault_hook: FaultHook | None = None) -> Future:
    """Like ``save``, returning a ``concurrent.futures.Future`` done once the checkpoint is
    committed. This rank's share is copied to CPU memory before returning, so training may
    change the tensors right away. A save first waits for the previous one; if that failed, its
    error is raised here (or by its ``future.result()``). ``no_dist`` as for ``save``."""
    wait_previous()
    process_group = exchange.NO_DIST if no_dist else process_group
    final, tmp, plan = _prepare(state_dict, checkpoint_id, process_group)
    plan.items = [WriteItem(i.name, LocalChunk(i.chunk.offsets, _staged(i.chunk.tensor)))
                  for i in plan.items]
    future: Future = Future()
    thread = threading.Thread(target=_background, args=(future, final, tmp, plan, _fault_hook),
                              name="shardwise-async-save", daemon=False)
    thread.start()
    _pending.append(future)
    return future


def wait_previous() -> None:
    """Wait for this process's previous ``async_save``; raise its error if it failed."""
    while _pending:
        future = _pending.pop()
        err = future.exception()
        if err is not None:
            raise CheckpointError(f"the previous async_save failed: {err}") from err


def _staged(t):
    return t.detach().to("cpu", copy=True).contiguous()


def _background(future: Future, final: Path, tmp: Path, plan: SavePlan,
                fault_hook: FaultHook | None) -> None:
    try:
        _write(tmp, plan, fault_hook)
        if plan.rank == 0:
            parts = commit_mod.wait_for_parts(tmp, plan, ASYNC_COMMIT_TIMEOUT_S)
            commit_mod.commit(tmp, final, plan, parts, fault_hook)
        else:
            commit_mod.wait_for_final(final, plan, ASYNC_COMMIT_TIMEOUT_S)
        plan.items = []  # drop the staged copy
        future.set_result(None)
    except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
        plan.items = []
        commit_mod.write_failure(tmp, plan, err)
        future.set_exception(err)


def _prepare(state_dict: dict[str, Any], checkpoint_id: Any, group
             ) -> tuple[Path, Path, SavePlan]:
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    state_dict = stateful.expand(state_dict)
    final = checkpoint_dir(checkpoint_id)
    tmp = tmp_dir(final)
    rank, _ = exchange.rank_and_world(group)
    error = None
    if rank == 0:
        error = _try(lambda: _fresh_dir(tmp))
    flat = flatten(state_dict)
    return final, tmp, make_plan(flat, group, error)


def _fresh_dir(tmp: Path) -> None:
    """Empty ``<id>.tmp`` (a leftover of a failed save) and make it anew; a link planted there
    is refused, never followed or emptied."""
    if tmp.is_symlink():
        raise CheckpointError(f"{tmp} is a symbolic link; refusing to save through it")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _write(tmp: Path, plan: SavePlan, fault_hook: FaultHook | None) -> None:
    name = rank_file(plan.rank)
    records = write_file(tmp / name, plan.items, fault_hook)
    commit_mod.write_part(tmp, plan, name, records)
    if fault_hook is not None:
        fault_hook("parts", plan.rank)


def _try(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to every rank, then raised
        return f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
    return None


def _raise_any(errors: list[str | None], what: str) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"save failed while {what}: " + "; ".join(
            f"rank {r}: {e}" for r, e in failed))


def _commit_now(tmp: Path, final: Path, plan: SavePlan, fault_hook: FaultHook | None) -> None:
    parts = commit_mod.wait_for_parts(tmp, plan, timeout_s=60.0)
    commit_mod.commit(tmp, final, plan, parts, fault_hook)
