"""The training loop each rank of `shardwise train` runs.

Per step: this rank's slice of the global batch, forward, backward, optimizer step. The logged
loss is the mean over all ranks (one small all-reduce per step), so every rank and every world
size reports the same number. The same all-reduce carries the preemption flag and a vote on
whether there is time to save (see launch/preemption.py), so that every rank stops after
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

from shardwise.checkpoint import remove_leftovers
from shardwise.checkpoint.saver import FaultHook
from shardwise.cli.checkpointing import Checkpointer
from shardwise.cli.optim import lr_at
from shardwise.cli.run_log import RunLog
from shardwise.cli.strategies import Prepared, get_builder
from shardwise.cli.train_args import TrainConfig
from shardwise.data import BatchStream, TokenWindows, load_corpus
from shardwise.dp.data_parallel import MIB
from shardwise.launch.preemption import Preempted, Preemption
from shardwise.launch.progress import beat
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
          preemption: Preemption | None = None, *,
          _fault_hook: FaultHook | None = None) -> TrainResult:
    """Train the demo GPT with ``cfg.strategy`` on ``group``; every rank calls this.

    Raises ``Preempted`` (on every rank) when ``preemption`` was requested on any rank: after
    the current step, with a checkpoint when ``cfg.checkpoint_dir`` is set and the grace period
    leaves time for one. ``_fault_hook`` (tests only) goes to every checkpoint save (saver.py).
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
    saver = _checkpointer(cfg, prepared, group, _fault_hook)
    result.start_step = _maybe_resume(cfg, saver, rank)
    val = _val_windows(corpus.val, cfg, index, count)
    if result.start_step == 0:
        result.val_start = evaluate(prepared, val, group, device)
    log = RunLog(cfg.log_dir, group, device) if cfg.log_dir else None
    try:
        _run_steps(cfg, prepared, train_stream, group, device, result, preemption,
                   saver, log)
    finally:
        if log is not None:
            log.plot()
            log.close()
    result.val_end = evaluate(prepared, val, group, device)
    if saver is not None:
        _save(saver, cfg.steps, result, background=False)
    return result


def _run_steps(cfg, prepared: Prepared, stream: BatchStream, group, device, result,
               preemption: Preemption | None, saver: Checkpointer | None,
               log: RunLog | None = None) -> None:
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
        if log is not None:
            log.step(done, result.losses[step], lr_at(step, cfg), tokens)
        if stop:
            bar.close()
            saved = saver is not None and can_save
            if saved:
                _save(saver, done, result, background=False)
            elif saver is not None:
                saver.finish()
            raise Preempted(done, saved)
        if saver and cfg.checkpoint_every and done % cfg.checkpoint_every == 0 \
                and done < cfg.steps:
            _save(saver, done, result, background=cfg.async_checkpoint)
            if log is not None:
                log.plot()
        if done % cfg.log_every == 0 or done == cfg.steps:
            result.tokens_per_s = counted * tokens / (time.perf_counter() - t0)
            result.peak_mib = _peak_per_rank(group, device)  # a collective: every log_every
            if rank == 0 and not cfg.progress:
                print(f"step {done}/{cfg.steps} loss {result.losses[step]!r}", flush=True)
        # every step: the loss was all-reduced above, so the bar shows this step's
        bar.set_postfix_str(_postfix(result.losses[step], result), refresh=False)
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
    """The bar's text: this step's loss, and throughput and memory as of the last log step."""
    if not result.peak_mib:  # no log step yet
        return f"loss={loss:.4f}"
    mem = "/".join(f"{m:.0f}" for m in result.peak_mib)
    return f"loss={loss:.4f} tok/s={result.tokens_per_s:,.0f} peak MiB/rank={mem}"


def _checkpointer(cfg: TrainConfig, prepared: Prepared, group,
                  fault_hook: FaultHook | None) -> Checkpointer | None:
    if not cfg.checkpoint_dir:
        return None
    record = {"model": asdict(cfg.model_config()), "strategy": cfg.strategy, "seed": cfg.seed,
              "batch_size": cfg.batch_size, "lr": cfg.lr}
    return Checkpointer(cfg.checkpoint_dir, prepared, group, record, cfg.keep, fault_hook)


def _save(saver: Checkpointer, step: int, result: TrainResult, background: bool) -> None:
    """Save after ``step`` steps; a foreground save first waits for a background one. The
    time a foreground save takes is what a preemption must leave room for."""
    waited = saver.finish()
    stalled = saver.save(step, background)
    if not background:
        result.save_seconds = stalled
    elif waited is not None:
        result.save_seconds = waited


def _maybe_resume(cfg: TrainConfig, saver: Checkpointer | None, rank: int) -> int:
    if not cfg.resume or saver is None:
        return 0
    step, meta, path = saver.resume()
    if rank == 0:
        print(f"resumed from {path} at step {step} (saved by {meta['strategy']} at world size "
              f"{meta['world_size']})", file=sys.stderr, flush=True)
    return step
