"""The training loop each rank of `shardwise train` runs.

Per step: this rank's slice of the global batch, forward, backward, optimizer step. The logged
loss is the mean over all ranks (one small all-reduce per step), so every rank and every world
size reports the same number. The same all-reduce carries the preemption flag and a vote on
whether there is time to save (see distributed/preemption.py), so that every rank stops after
the same step and saves, or not, together. Validation loss is measured before and after
training on a fixed set of windows split across ranks (sum and count all-reduced).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from shardwise.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_rank_state,
    prune,
    read_meta,
    remove_leftovers,
    save_train_state,
)
from shardwise.cli.optim import lr_at
from shardwise.cli.strategies import Prepared, get_builder
from shardwise.cli.train_args import TrainConfig
from shardwise.data import BatchStream, TokenWindows, load_corpus
from shardwise.distributed.data_parallel import MIB
from shardwise.distributed.preemption import Preempted, Preemption
from shardwise.distributed.progress import beat
from shardwise.memory import peak_memory_bytes
from shardwise.models import GPT, lm_loss


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss over ranks
    val_start: float | None = None
    val_end: float | None = None
    peak_mib: list[float] = field(default_factory=list)  # per rank
    tokens_per_s: float = 0.0
    start_step: int = 0
    save_seconds: float = 1.0  # how long the last save took (a guess before the first)


def train(cfg: TrainConfig, group: dist.ProcessGroup, device: torch.device,
          preemption: Preemption | None = None) -> TrainResult:
    """Train the demo GPT with ``cfg.strategy`` on ``group``; every rank calls this.

    Raises ``Preempted`` (on every rank) when ``preemption`` was requested on any rank: after
    the current step, with a checkpoint when ``cfg.checkpoint_dir`` is set and the grace period
    leaves time for one.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if cfg.checkpoint_dir and rank == 0:
        remove_leftovers(cfg.checkpoint_dir)
    corpus = load_corpus(cfg.corpus_bytes)
    torch.manual_seed(cfg.seed)
    prepared = get_builder(cfg.strategy)(GPT(cfg.model_config()), cfg, group, device)
    index, count = prepared.data_slice or (rank, world)
    train_stream = BatchStream(TokenWindows(corpus.train, cfg.seq_len), cfg.batch_size, index,
                               count, seed=cfg.seed)
    result = TrainResult()
    result.start_step = _maybe_resume(cfg, prepared, rank)
    val = _val_windows(corpus.val, cfg, index, count)
    if result.start_step == 0:
        result.val_start = evaluate(prepared, val, group, device)
    _run_steps(cfg, prepared, train_stream, group, device, result, preemption)
    result.val_end = evaluate(prepared, val, group, device)
    if cfg.checkpoint_dir:
        _save(cfg, prepared, cfg.steps, world, group, result)
    return result


def _run_steps(cfg, prepared: Prepared, stream: BatchStream, group, device, result,
               preemption: Preemption | None) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    bar = tqdm(total=cfg.steps, initial=result.start_step, disable=not (cfg.progress and rank == 0),
               desc=f"{cfg.strategy} x{world}", unit="step", mininterval=0.5, dynamic_ncols=True)
    tokens = cfg.batch_size * cfg.seq_len
    t0 = time.perf_counter()
    for counted, step in enumerate(range(result.start_step, cfg.steps), start=1):
        loss = _step(prepared, stream, step, cfg, device)
        stop, can_save = _share_loss(loss, preemption, result, group)
        result.losses[step] = loss[0].item() / world
        beat()
        done = step + 1
        if stop:
            bar.close()
            saved = bool(cfg.checkpoint_dir) and can_save
            if saved:
                _save(cfg, prepared, done, world, group, result)
            raise Preempted(done, saved)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            _save(cfg, prepared, done, world, group, result)
        if done % cfg.log_every == 0 or done == cfg.steps:
            result.tokens_per_s = counted * tokens / (time.perf_counter() - t0)
            result.peak_mib = _peak_per_rank(group, device)
            bar.set_postfix_str(_postfix(result.losses[step], result), refresh=False)
            if rank == 0 and not cfg.progress:
                print(f"step {done}/{cfg.steps} loss {result.losses[step]!r}", flush=True)
        bar.update(1)
    bar.close()


def _share_loss(loss: torch.Tensor, preemption: Preemption | None, result: TrainResult,
                group) -> tuple[bool, bool]:
    """All-reduce (sum) this rank's loss in place, with two more numbers in the same message:
    whether any rank was asked to stop, and whether every rank has time to save."""
    asked = preemption is not None and preemption.requested()
    time_ok = preemption is None or preemption.time_left() > 2 * result.save_seconds
    extra = torch.tensor([float(asked), float(time_ok)], dtype=loss.dtype, device=loss.device)
    both = torch.cat([loss, extra])
    dist.all_reduce(both, group=group)
    loss.copy_(both[:1])
    return both[1].item() > 0, both[2].item() == dist.get_world_size(group)


def _step(prepared: Prepared, stream: BatchStream, step: int, cfg: TrainConfig,
          device: torch.device) -> torch.Tensor:
    for group in prepared.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    x, y = stream.batch(step)
    x, y = x.to(device), y.to(device)
    if prepared.train_step is not None:
        loss = prepared.train_step(x, y)
    else:
        loss = lm_loss(prepared.model(x), y)
        loss.backward()
    prepared.optimizer.step()
    prepared.optimizer.zero_grad(set_to_none=True)
    return loss.detach().float().reshape(1)


@torch.no_grad()
def evaluate(prepared: Prepared, windows: list[tuple[torch.Tensor, torch.Tensor]],
             group: dist.ProcessGroup, device: torch.device) -> float:
    """Mean validation loss over every rank's windows (sum and count all-reduced)."""
    prepared.model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in windows:
        totals[0] += lm_loss(prepared.model(x.to(device)), y.to(device)).double() * x.shape[0]
        totals[1] += x.shape[0]
    prepared.model.train()
    dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1]).item()


def _val_windows(data: torch.Tensor, cfg: TrainConfig, rank: int, world: int):
    stream = BatchStream(TokenWindows(data, cfg.seq_len), cfg.batch_size, rank, world,
                         seed=cfg.seed, shuffle=False)
    steps = min(cfg.eval_batches, stream.steps_per_epoch)
    return [stream.batch(k) for k in range(steps)]


def _peak_per_rank(group: dist.ProcessGroup, device: torch.device) -> list[float]:
    mine = torch.tensor([peak_memory_bytes(device) / MIB], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.item() for t in everyone]


def _postfix(loss: float, result: TrainResult) -> str:
    mem = "/".join(f"{m:.0f}" for m in result.peak_mib)
    return f"loss={loss:.4f} tok/s={result.tokens_per_s:,.0f} peak MiB/rank={mem}"


def _save(cfg: TrainConfig, prepared: Prepared, step: int, world: int, group,
          result: TrainResult) -> None:
    start = time.perf_counter()
    meta = {"model": asdict(cfg.model_config()), "strategy": cfg.strategy, "world_size": world,
            "seed": cfg.seed, "batch_size": cfg.batch_size, "lr": cfg.lr}
    save_train_state(cfg.checkpoint_dir, step, prepared.state_dict(), meta,
                     prepared.per_rank_state, group)
    if cfg.keep and dist.get_rank(group) == 0:
        prune(cfg.checkpoint_dir, cfg.keep)
    result.save_seconds = time.perf_counter() - start


def _first_mismatch(saved, own, where: str = "state") -> str | None:
    """Where ``saved`` does not have the structure of ``own`` (keys, lengths, tensor shapes and
    dtypes), so that a checkpoint of another layout is refused before anything is loaded."""
    if isinstance(own, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"{where} is {type(saved).__name__} in the checkpoint, a tensor here"
        if saved.shape != own.shape or saved.dtype != own.dtype:
            return (f"{where} is {tuple(saved.shape)} {saved.dtype} in the checkpoint, "
                    f"{tuple(own.shape)} {own.dtype} here")
        return None
    if isinstance(own, dict):
        if not own:  # filled lazily (an optimizer's state before its first step)
            return None
        if not isinstance(saved, dict) or set(saved) != set(own):
            extra = sorted(map(str, set(saved) - set(own))) if isinstance(saved, dict) else []
            missing = sorted(map(str, set(own) - set(saved))) if isinstance(saved, dict) else []
            return f"{where} has other entries (only in the checkpoint: {extra[:3]}; " \
                   f"only here: {missing[:3]})"
        for key in own:
            found = _first_mismatch(saved[key], own[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(own, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(own):
            return f"{where} differs in length"
        for i, (a, b) in enumerate(zip(saved, own)):
            found = _first_mismatch(a, b, f"{where}[{i}]")
            if found:
                return found
    return None


def _optimizer_mismatch(saved: dict, optimizer: torch.optim.Optimizer) -> str | None:
    """For a plain torch optimizer (whose state is empty until its first step): the saved
    per-parameter state must have the shapes of this run's parameters."""
    saved = saved.get("optimizer") if isinstance(saved, dict) else None
    if not type(optimizer).__module__.startswith("torch.optim") or not isinstance(saved, dict):
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved.get("param_groups", [])
    count = sum(len(g.get("params", [])) for g in groups if isinstance(g, dict))
    if count != len(params):
        return f"the optimizer has {count} parameters in the checkpoint, {len(params)} here"
    for index, entry in saved.get("state", {}).items():
        for name, value in entry.items() if isinstance(entry, dict) else ():
            param = params[int(index)] if 0 <= int(index) < len(params) else None
            if isinstance(value, torch.Tensor) and value.dim() and (
                    param is None or value.shape != param.shape):
                shape = tuple(param.shape) if param is not None else None
                return (f"optimizer state {name!r} of parameter {index} is "
                        f"{tuple(value.shape)} in the checkpoint, the parameter is {shape} here")
    return None


def _maybe_resume(cfg: TrainConfig, prepared: Prepared, rank: int) -> int:
    if not cfg.resume:
        return 0
    path = latest_checkpoint(cfg.checkpoint_dir)
    meta = read_meta(path)
    state = load_rank_state(path, rank)
    mismatch = _first_mismatch(state, prepared.state_dict()) or _optimizer_mismatch(
        state, prepared.optimizer)
    if mismatch:
        raise CheckpointError(
            f"checkpoint {path} (strategy {meta['strategy']}, world size {meta['world_size']}) "
            f"cannot be loaded by strategy {cfg.strategy} at world size "
            f"{dist.get_world_size()}: {mismatch}"
        )
    try:
        prepared.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise CheckpointError(
            f"checkpoint {path} (strategy {meta['strategy']}, world size {meta['world_size']}) "
            f"cannot be loaded by strategy {cfg.strategy}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if rank == 0:
        print(f"resumed from {path} at step {meta['step']}", file=sys.stderr, flush=True)
    return int(meta["step"])
