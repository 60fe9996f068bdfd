"""`shardwise train`'s arguments and their validation (done before any rank is started)."""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.cli.mesh_args import add_mesh_args, mesh_problem
from shardwise.cli.ranges import (
    COUNT,
    COUNT0,
    LAYERS,
    LR,
    SEED,
    human_bytes,
    int_arg,
    physical_memory,
    ranks_problem,
)
from shardwise.cli.strategies import STRATEGIES, check_strategy, strategy_names

if TYPE_CHECKING:
    from shardwise.models import GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    nproc: int = 2
    strategy: str = "ddp"
    device: str = "cpu"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    steps: int = 200
    batch_size: int = 16  # global: split across the ranks
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    eval_batches: int = 8
    log_every: int = 10
    corpus_bytes: int = 4 * 1024 * 1024
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    override: tuple[str, ...] = ()  # what a resume may change: names in OVERRIDABLE
    keep: int = 0  # checkpoints to keep (0: all)
    async_checkpoint: bool = False  # --checkpoint-every saves written in the background
    mixed_precision: str | None = None
    cpu_offload: bool = False
    progress: bool = True
    log_dir: str | None = None  # metrics, loss curve, TensorBoard events (cli/run_log.py)
    replicas: int = 0  # hsdp: replicas (0: one per node); see cli/mesh_args.py
    tp: int = 1  # fsdp: tensor-parallel degree (FSDP x TP)
    # --strategy pipeline only (see add_pipeline_args)
    schedule: str = "1f1b"
    microbatches: int = 2
    dp: int = 1
    transport: str = "p2p"

    def model_config(self) -> GPTConfig:
        from shardwise.models import GPTConfig

        return GPTConfig(seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                         d_model=self.d_model)


CORPUS_BYTES = int_arg(1, 2**30, " (1 GiB)")
# the flags only FullyShardedDataParallel takes, and the strategies that build one
FSDP_ONLY_FLAGS = ("mixed_precision", "cpu_offload")
FSDP_ONLY_STRATEGIES = ("fsdp", "hsdp")
STATE_BYTES_PER_PARAM = 16  # fp32 parameters, gradients and AdamW's two moments

# What `--resume` compares with the checkpoint, and `--override` may allow to differ.
OVERRIDABLE = ("seed", "batch_size", "lr", "model", "strategy")


class ConfigError(ValueError):
    """The command line asks for something that cannot run; the message says what."""


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = TrainConfig()
    add = parser.add_argument
    add("--nproc", type=COUNT, default=d.nproc,
        help="local ranks to start (ignored under torchrun)")
    add("--strategy", default=d.strategy,
        help="; ".join(f"{k}: {v[1]}" for k, v in sorted(STRATEGIES.items())))
    add("--device", default=d.device, choices=["cpu", "cuda"], help="cuda uses NCCL")
    add("--n-layer", type=LAYERS, default=d.n_layer, help="demo GPT: transformer blocks")
    add("--n-head", type=COUNT, default=d.n_head,
        help="demo GPT: attention heads (must divide --d-model)")
    add("--d-model", type=COUNT, default=d.d_model, help="demo GPT: embedding width")
    add("--seq-len", type=COUNT, default=d.seq_len, help="tokens per training window")
    add("--steps", type=COUNT, default=d.steps,
        help="train until this step (counting resumed ones)")
    add("--batch-size", type=COUNT, default=d.batch_size, help="global batch, split across ranks")
    add("--lr", type=LR, default=d.lr, help="AdamW's learning rate (constant after --warmup)")
    add("--warmup", type=COUNT0, default=d.warmup, help="linear warm-up steps")
    add("--seed", type=SEED, default=d.seed, help="model initialisation and data order")
    add("--eval-batches", type=COUNT, default=d.eval_batches,
        help="validation batches at start/end")
    add("--log-every", type=COUNT, default=d.log_every,
        help="steps between throughput and memory updates (and lines with --no-progress)")
    add("--corpus-bytes", type=CORPUS_BYTES, default=d.corpus_bytes,
        help="bytes of stdlib source to read")
    add("--checkpoint-dir", default=d.checkpoint_dir,
        help="save checkpoints here (default: none are saved)")
    add("--checkpoint-every", type=COUNT0, default=d.checkpoint_every, help="0: only at the end")
    add("--resume", action="store_true", help="continue from --checkpoint-dir's latest checkpoint")
    add("--override", type=_override_list, default=(),
        help="what a --resume may change from the checkpoint's run, comma-separated: "
             + ", ".join(OVERRIDABLE))
    add("--keep", type=COUNT0, default=d.keep, help="keep the newest N checkpoints (0: all)")
    add("--async-checkpoint", action="store_true",
        help="write --checkpoint-every saves in the background while training goes on")
    add("--mixed-precision", default=None, choices=["bf16", "fp16"],
        help=f"{' and '.join(FSDP_ONLY_STRATEGIES)} only")
    add("--cpu-offload", action="store_true", help=f"{' and '.join(FSDP_ONLY_STRATEGIES)} only")
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")
    _add_log_args(parser)
    add_mesh_args(parser, d.replicas, d.tp)
    add_pipeline_args(parser)
    return parser


def _add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-dir", default=None,
                        help="write metrics.jsonl, loss.png and (with tensorboard installed) "
                             "TensorBoard events here")


PIPELINE_FLAGS = ("schedule", "microbatches", "dp", "transport")


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    add = parser.add_argument
    add("--schedule", default=d.schedule, choices=["gpipe", "1f1b"], help="pipeline only")
    add("--microbatches", type=COUNT, default=d.microbatches,
        help="pipeline only: micro-batches per step (must divide the batch per replica)")
    add("--dp", type=COUNT, default=d.dp,
        help="pipeline only: data-parallel replicas of the pipeline (stages = nproc / dp)")
    add("--transport", default=d.transport, choices=["p2p", "rpc"],
        help="pipeline only: c10d point-to-point, or RPC with distributed autograd")


def validate_pipeline(cfg: TrainConfig, world_size: int) -> None:
    """The pipeline flags: refused with another strategy; the layout must fit the world,
    the model and the batch."""
    if cfg.strategy != "pipeline":
        d = TrainConfig()
        set_ = [f"--{n}" for n in PIPELINE_FLAGS if getattr(cfg, n) != getattr(d, n)]
        if set_:
            raise ConfigError(f"{', '.join(set_)} only apply to --strategy pipeline")
        return
    _positive(cfg, "microbatches", "dp")
    if cfg.transport == "rpc" and cfg.device != "cpu":
        raise ConfigError("--strategy pipeline --transport rpc runs on CPU (CUDA device maps "
                          "are not wired into the CLI); use --transport p2p")
    if world_size % cfg.dp:
        raise ConfigError(f"--dp {cfg.dp} does not divide the world size {world_size}")
    stages = world_size // cfg.dp
    if stages > cfg.n_layer + 2:
        raise ConfigError(f"a pipeline of {stages} stages needs at least {stages - 2} layers "
                          f"(--n-layer is {cfg.n_layer})")
    per_replica = cfg.batch_size // cfg.dp
    if cfg.batch_size % cfg.dp or per_replica % cfg.microbatches:
        raise ConfigError(f"--batch-size {cfg.batch_size} gives {cfg.batch_size / cfg.dp:g} "
                          f"samples per replica (--dp {cfg.dp}), not divisible by "
                          f"--microbatches {cfg.microbatches}")


def _override_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().replace("-", "_") for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in OVERRIDABLE]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown name(s) {', '.join(unknown)}; --override takes {', '.join(OVERRIDABLE)}")
    return names


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def validate(cfg: TrainConfig, world_size: int, nnodes: int = 1) -> None:
    """Raise ConfigError naming the first problem found; also checks the resume checkpoint."""
    check_arguments(cfg, world_size, nnodes)
    check_files(cfg, world_size)


def check_arguments(cfg: TrainConfig, world_size: int, nnodes: int = 1) -> None:
    """What the arguments alone decide (arithmetic, no file read, no torch for the CPU)."""
    _positive(cfg, "nproc", "steps", "batch_size", "n_layer", "n_head", "d_model", "seq_len",
              "eval_batches", "log_every", "corpus_bytes")
    problem = ranks_problem(cfg.nproc)
    if problem:
        raise ConfigError(problem)
    try:
        check_strategy(cfg.strategy)
        cfg.model_config()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not cfg.lr > 0 or cfg.lr == float("inf"):
        raise ConfigError(f"--lr must be positive and finite, got {cfg.lr}")
    if cfg.keep < 0:
        raise ConfigError(f"--keep must be at least 0, got {cfg.keep}")
    _check_fsdp_only(cfg)
    _check_device(cfg)
    validate_pipeline(cfg, world_size)
    if cfg.batch_size < world_size:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is smaller than the world size {world_size}: "
            "every rank needs at least one sample (the batch size is global)"
        )
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is not divisible by the world size {world_size}"
        )
    problem = mesh_problem(cfg, world_size, nnodes)
    if problem:
        raise ConfigError(problem)
    _check_memory(cfg, world_size)
    for flag, value in (("--checkpoint-dir", cfg.checkpoint_dir), ("--log-dir", cfg.log_dir)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} must name a directory, got an empty string")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir to know where to resume from")


def check_files(cfg: TrainConfig, world_size: int) -> None:
    """What needs the files: the corpus is long enough, the directories are writable, the
    checkpoint to resume from fits this run."""
    _check_corpus(cfg, world_size)
    if cfg.checkpoint_dir:
        _check_writable(Path(cfg.checkpoint_dir))
    if cfg.log_dir:
        _check_writable(Path(cfg.log_dir), "--log-dir", "so that the run's metrics are not lost")
    if cfg.resume:
        check_resumable(cfg, world_size)


def check_resumable(cfg: TrainConfig, world_size: int) -> None:
    """Refuse a resume whose run differs from the checkpoint's (every difference listed) unless
    ``--override`` allows it; and one that cannot work at all."""
    from shardwise.checkpoint import CheckpointError, latest_checkpoint, read_meta

    try:
        path = latest_checkpoint(cfg.checkpoint_dir)
        meta = read_meta(path)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    diffs = [d for name, d in _differences(cfg, meta) if name not in cfg.override]
    if diffs:
        raise ConfigError(
            f"checkpoint {path} is of a different model or run: {'; '.join(diffs)}. "
            "Resume with the same settings, or name what may change with --override "
            f"(one or more of {','.join(OVERRIDABLE)})"
        )
    if meta["step"] >= cfg.steps:
        raise ConfigError(f"checkpoint {path} is already at step {meta['step']} >= --steps "
                          f"{cfg.steps}: nothing left to train")


def _differences(cfg: TrainConfig, meta: dict) -> list[tuple[str, str]]:
    """(override name, description) of each way this run differs from the checkpoint's."""
    found = [("model", f"{k}={meta['model'].get(k)} (this run: {v})")
             for k, v in asdict(cfg.model_config()).items() if meta["model"].get(k) != v]
    if meta["strategy"] != cfg.strategy:
        found.append(("strategy", f"strategy={meta['strategy']} (this run: {cfg.strategy})"))
    for name in ("seed", "batch_size", "lr"):
        if name in meta and meta[name] != getattr(cfg, name):
            flag = "--" + name.replace("_", "-")
            found.append((name, f"{flag}={meta[name]} (this run: {getattr(cfg, name)})"))
    return found


def _check_fsdp_only(cfg: TrainConfig) -> None:
    if cfg.strategy in FSDP_ONLY_STRATEGIES:
        return
    for name in FSDP_ONLY_FLAGS:
        if getattr(cfg, name):
            raise ConfigError(f"--{name.replace('_', '-')} applies to --strategy "
                              f"{' or '.join(FSDP_ONLY_STRATEGIES)} only, not {cfg.strategy}")


def _check_device(cfg: TrainConfig) -> None:
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine "
                          "(torch.cuda.is_available() is False); use --device cpu")
    if cfg.nproc > torch.cuda.device_count():
        raise ConfigError(f"--device cuda with --nproc {cfg.nproc} needs a GPU per rank; this "
                          f"machine has {torch.cuda.device_count()}")


def gpt_parameters(cfg: TrainConfig) -> int:
    """The demo GPT's parameter count from its shape (closed form: nothing is built)."""
    m = cfg.model_config()
    d, ffn = m.d_model, m.mlp_ratio * m.d_model
    per_layer = 4 * d * d + d + 2 * d * ffn + ffn + d + 4 * d  # attention, MLP, two norms
    head = 0 if m.tie_weights else m.vocab_size * d
    return m.n_layer * per_layer + (m.vocab_size + m.seq_len) * d + 2 * d + head


def _check_memory(cfg: TrainConfig, world_size: int) -> None:
    """The least this machine's ranks need (training state sharded over the whole world,
    each rank's activations) must fit its memory."""
    from shardwise.memory.activations import TransformerShape, activation_bytes

    m = cfg.model_config()
    shape = TransformerShape(m.n_layer, m.d_model, m.n_head, m.n_head, m.mlp_ratio * m.d_model,
                             m.vocab_size, "gelu", m.seq_len)
    params = gpt_parameters(cfg)
    per_rank = max(cfg.batch_size // world_size, 1)
    need = (STATE_BYTES_PER_PARAM * params * cfg.nproc // world_size
            + cfg.nproc * activation_bytes(shape, per_rank, m.seq_len))
    have = physical_memory()
    if need > have:
        raise ConfigError(
            f"the model is too large for this machine: --n-layer {m.n_layer}, --d-model "
            f"{m.d_model}, --seq-len {m.seq_len}, --batch-size {cfg.batch_size} make {params:.3g} "
            f"parameters; {cfg.nproc} ranks here need at least {human_bytes(need)} for training "
            f"state and activations, and the machine has {human_bytes(have)}")


def _check_corpus(cfg: TrainConfig, world_size: int) -> None:
    """``--corpus-bytes`` must give every rank a batch of windows, in training and evaluation."""
    from shardwise.data import BatchStream, TokenWindows, load_corpus

    try:
        corpus = load_corpus(cfg.corpus_bytes)
        for split in (corpus.train, corpus.val):
            BatchStream(TokenWindows(split, cfg.seq_len), cfg.batch_size, 0, world_size)
    except ValueError as exc:
        raise ConfigError(f"--corpus-bytes {cfg.corpus_bytes} is too small for --seq-len "
                          f"{cfg.seq_len} and --batch-size {cfg.batch_size}: {exc}") from None


def _positive(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def _check_writable(directory: Path, flag: str = "--checkpoint-dir",
                    why: str = "so that checkpoints are not lost") -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {directory} is not writable ({exc.strerror or exc}); "
            f"choose a directory this user can write, {why}"
        ) from None
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"{flag} {directory} is not writable")


__all__ = ["ConfigError", "TrainConfig", "build_parser", "check_arguments", "check_files",
           "config_from_args", "strategy_names", "validate"]
