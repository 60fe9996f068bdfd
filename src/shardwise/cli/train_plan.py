"""The line `shardwise train` prints before any rank starts: what will run, where, on what.

Everything here is arithmetic on the arguments (no torch): the model's size comes from the
closed-form count of :func:`shardwise.cli.train_args.gpt_parameters`.
"""

from __future__ import annotations

from shardwise.cli.train_args import TrainConfig, gpt_parameters


def batch_ways(cfg: TrainConfig, world_size: int) -> int:
    """Into how many slices each global batch is split: one per data-parallel rank (all ranks
    under ddp/zero/fsdp/hsdp, one per tensor-parallel group under fsdp --tp, the replicas of a
    pipeline, one under tp, whose ranks all work on the whole batch)."""
    if cfg.strategy == "tp":
        return 1
    if cfg.strategy == "pipeline":
        return cfg.dp
    return world_size // cfg.tp if cfg.strategy == "fsdp" else world_size


def count(n: int) -> str:
    """A parameter count as people say it: 812, 5.3K, 0.84M, 7.5B."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def plan_line(cfg: TrainConfig, nnodes: int = 1) -> str:
    """One line: strategy and ranks, model size and shape, batch, steps, where things go."""
    world = cfg.nproc * nnodes
    m = cfg.model_config()
    ways = batch_ways(cfg, world)
    per = f"{cfg.batch_size // ways} per {'replica' if cfg.strategy == 'pipeline' else 'rank'}"
    if ways == 1:
        per = "every rank the whole batch"
    layout = f" ({nnodes} node{'s' if nnodes > 1 else ''} x {cfg.nproc})"
    saved = "checkpoints: none"
    if cfg.checkpoint_dir:
        every = f"every {cfg.checkpoint_every} steps" if cfg.checkpoint_every else "at the end"
        saved = f"checkpoints: {cfg.checkpoint_dir} ({every})"
    logs = f"; metrics: {cfg.log_dir}" if cfg.log_dir else ""
    return (f"shardwise train: {cfg.strategy} on {world} ranks{layout}; GPT of "
            f"{count(gpt_parameters(cfg))} parameters ({m.n_layer} layers, {m.n_head} heads, "
            f"d_model {m.d_model}, seq_len {m.seq_len}); batch {cfg.batch_size} ({per}); "
            f"{cfg.steps} steps; {saved}{logs}")
