"""One rank of `shardwise train`: join the group, train, report, leave.

SIGTERM stops training gracefully (after the current step, with a checkpoint when there is time:
launch/preemption.py) and the rank exits 143. After a restart by the launcher
(``TORCHELASTIC_RESTART_COUNT`` above 0), training resumes from the latest complete checkpoint
in ``--checkpoint-dir`` on its own.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.checkpoint import CheckpointError
from shardwise.cli.train_args import ConfigError, TrainConfig, validate
from shardwise.cli.train_loop import train
from shardwise.distributed import destroy, init, pick_backend, read_env
from shardwise.launch.preemption import EXIT_PREEMPTED, Preempted, Preemption


def train_rank(cfg: TrainConfig) -> int:
    preemption = Preemption().install()
    env = read_env()
    cfg = _resume_after_restart(cfg, env.restart_count)
    try:
        validate(cfg, env.world_size, _nodes(env.world_size))
    except ConfigError as exc:
        print(f"shardwise train: error: {exc}", file=sys.stderr)
        return 2
    device = _device(cfg, env.local_rank)
    group = init(pick_backend(device))
    try:
        result = train(cfg, group, device, preemption)
        dist.barrier(group=group)  # leave together: rank 0's store must outlive the others' use
    except Preempted as stop:
        if dist.get_rank(group) == 0:
            print(f"shardwise train: {stop}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except CheckpointError as exc:
        print(f"shardwise train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        destroy()
    if env.rank == 0:
        _print_result(result)
    return 0


def _resume_after_restart(cfg: TrainConfig, restart_count: int) -> TrainConfig:
    """After a restart, continue from the latest complete checkpoint if there is one."""
    if restart_count == 0 or cfg.resume or not cfg.checkpoint_dir:
        return cfg
    if not (Path(cfg.checkpoint_dir) / "latest").is_file():
        return cfg
    if read_env().rank == 0:
        print(f"shardwise train: restart {restart_count}: resuming from {cfg.checkpoint_dir}",
              file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, resume=True)


def _print_result(result) -> None:
    last = max(result.losses) if result.losses else None
    if result.val_start is not None:
        print(f"validation loss at start: {result.val_start:.4f}")
    print(f"validation loss at end:   {result.val_end:.4f}")
    if last is not None:
        print(f"train loss at step {last + 1}: {result.losses[last]:.6f}")
    mem = ", ".join(f"rank{r} {m:.0f} MiB" for r, m in enumerate(result.peak_mib))
    print(f"throughput: {result.tokens_per_s:,.0f} tokens/s; peak memory: {mem}")


def _nodes(world_size: int) -> int:
    """Nodes in the job: the world over the ranks per node (LOCAL_WORLD_SIZE)."""
    from shardwise.distributed.topology import local_world_size_from_env

    return max(1, world_size // local_world_size_from_env(world_size))


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("shardwise train: error: --device cuda but no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
