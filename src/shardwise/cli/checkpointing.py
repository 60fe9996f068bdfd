"""`shardwise train`'s checkpoints (``--checkpoint-dir``, ``--resume``, ``--async-checkpoint``,
``--keep``) through ``shardwise.checkpoint``.

Every strategy's model and AdamW state is taken by ``get_state_dict``: the demo GPT's parameter
names and global shapes, each rank holding its share (DDP's replicated tensors, written once;
ZeRO's optimizer state, written by its owners; FSDP's and tensor parallelism's shards, written
by their holders). Every rank writes its own file in parallel. So a run resumes under any
strategy and world size: ``load`` reshards the saved chunks into this run's layout, reading
only the byte ranges each rank needs. The run's record (model config, strategy, world size,
step, seed, batch size, learning rate) is a JSON value in the same checkpoint.

The step is all a resume needs beyond the model and optimizer: the learning rate and the data
position are functions of the step, and training draws no random numbers (the demo GPT has no
dropout).

With ``--async-checkpoint`` a save returns once this rank's share is copied to CPU memory and
is written by a background thread; the next save, a preemption's save and the end of training
first wait for it (its failure is raised then). ``latest`` is pointed at a checkpoint, and
``--keep`` prunes older ones, only after it is complete.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint import (
    CheckpointError,
    async_save,
    get_model_state_dict,
    get_state_dict,
    latest_checkpoint,
    load,
    mark_latest,
    prune,
    read_meta,
    save,
    set_state_dict,
    step_dir,
)
from shardwise.checkpoint.saver import FaultHook
from shardwise.checkpoint.train_state import TRAIN_KEY
from shardwise.cli.strategies import Prepared


class Checkpointer:
    """Saves and restores one run's training state; every rank of ``group`` makes the same
    calls (save and async_save are collective)."""

    def __init__(self, directory: str, prepared: Prepared, group: dist.ProcessGroup,
                 record: dict[str, Any], keep: int = 0, fault_hook: FaultHook | None = None):
        self.directory, self.prepared, self.group = Path(directory), prepared, group
        self.record, self.keep = record, keep
        self.fault_hook = fault_hook  # tests only: handed to every save (saver.py)
        self.rank = dist.get_rank(group)
        self._pending: tuple[Future, Path, float] | None = None

    def save(self, step: int, background: bool = False) -> float:
        """Save the state after ``step`` steps as ``step_N``; the seconds the caller was
        stalled (the whole save, or the copy to CPU memory for a background one)."""
        self.finish()
        start = time.perf_counter()
        path = step_dir(self.directory, step)
        state = self._state(step)
        if background:
            future = async_save(state, checkpoint_id=path, process_group=self.group,
                                _fault_hook=self.fault_hook)
            self._pending = (future, path, start)
        else:
            save(state, checkpoint_id=path, process_group=self.group,
                 _fault_hook=self.fault_hook)
            self._committed(path)
        return time.perf_counter() - start

    def finish(self) -> float | None:
        """Wait for the background save, if any; the seconds it took in all (None if none)."""
        if self._pending is None:
            return None
        future, path, start = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - any failure of the writer thread
            raise CheckpointError(f"the background save of {path} failed: {exc}") from exc
        self._committed(path)
        return time.perf_counter() - start

    def resume(self) -> tuple[int, dict[str, Any], Path]:
        """Load the latest complete checkpoint into this run's model and optimizer, whatever
        the strategy and world size that saved it; (step, its record, path)."""
        path = latest_checkpoint(self.directory)
        try:
            meta = read_meta(path)  # the whole metadata validated first (checkpoint/validate.py)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {path} cannot be loaded by this run: {exc}") \
                from None
        state = self._state(meta["step"])
        try:
            load(state, checkpoint_id=path, process_group=self.group, strict=True)
            model = self.prepared.state_model or self.prepared.model
            full = {**get_model_state_dict(model), **state["model"]}
            optim = state["optim"]
            if self.prepared.owned_state is not None:
                optim = _own_groups(optim, self.prepared.owned_state)
            set_state_dict(model, self.prepared.optimizer, model_state_dict=full,
                           optim_state_dict=optim)
        except (CheckpointError, RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint {path} (strategy {meta['strategy']}, world size "
                f"{meta['world_size']}) cannot be loaded by this run: {exc}") from None
        return meta["step"], meta, path

    def _state(self, step: int) -> dict[str, Any]:
        model = self.prepared.state_model or self.prepared.model
        model_sd, optim_sd = get_state_dict(model, self.prepared.optimizer)
        owned = self.prepared.owned_state
        if owned is not None:  # a pipeline stage: its own layers; the groups name every layer
            optim_sd = _all_groups(optim_sd, [k for k, _ in model.named_parameters()])
            model_sd = {k: v for k, v in model_sd.items() if owned(k)}
        record = {**self.record, "step": step, "world_size": dist.get_world_size(self.group)}
        return {"model": model_sd, "optim": optim_sd, TRAIN_KEY: json.dumps(record)}

    def _committed(self, path: Path) -> None:
        if self.rank == 0:
            mark_latest(self.directory, path)
            if self.keep:
                prune(self.directory, self.keep)


def _all_groups(optim_sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A stage's optimizer state with its one param group naming every parameter of the
    model, as a one-stage run's would: the same value on every rank, whatever loads it."""
    if len(optim_sd["param_groups"]) != 1:
        raise CheckpointError("a checkpoint of a partial model needs an optimizer with one "
                              f"param group, not {len(optim_sd['param_groups'])}")
    return {**optim_sd, "param_groups": [{**optim_sd["param_groups"][0], "params": names}]}


def _own_groups(optim_sd: dict[str, Any], owned) -> dict[str, Any]:
    """The loaded param groups narrowed to the parameters this rank holds."""
    groups = [{**g, "params": [n for n in g["params"] if owned(n)]}
              for g in optim_sd["param_groups"]]
    return {**optim_sd, "param_groups": groups}
