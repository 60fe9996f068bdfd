"""ZeRO stages 1 and 2 against torch's ZeroRedundancyOptimizer and plain DDP + AdamW.

Same model (the demo GPT, d_model 512, 4 layers by default: large enough that optimizer state
and gradients dominate memory), same data (the stdlib corpus, each rank its slice of a global
batch), same world size, same AdamW:

- torch-ddp-adamw       torch DDP, AdamW replicated (the baseline)
- torch-ddp-zero1       torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer
- shardwise-ddp-zero1   our DDP + our ZeroRedundancyOptimizer (stage 1)
- shardwise-zero2       our ZeroDataParallel + our ZeroRedundancyOptimizer (stage 2)
- shardwise-zero1-overlap  our DDP + our ZeroRedundancyOptimizer(overlap_with_ddp=True),
                        stepped inside backward (hook_with_zero_step_interleaved)
- local-adamw           no wrapper and no communication: each rank steps on its own slice (the
                        world-size-1 step at the per-rank batch), for the physical limit: that
                        step plus the communication ours could not overlap (``exposed_comm_ms``)
torch's own overlap_with_ddp refuses gloo, so there is no torch row for it on CPU.

Besides step time and peak RSS, each rank counts its model-state bytes with
``shardwise.memory.state_bytes`` right after a backward (gradients present), before the step.

    shardwise bench zero --nproc 2 --rounds 3 --steps 20
    shardwise bench zero --nproc 2 --rounds 1 --steps 5 --mmap-threshold  # memory
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from shardwise.bench.gpt_steps import batch_stream, exposed_comm_probe, timed_steps
from shardwise.bench.limits import PATTERNS
from shardwise.bench.sidebyside import SideBySide, bench_device
from shardwise.ddp import DistributedDataParallel
from shardwise.memory import state_bytes
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.zero import (
    ZeroDataParallel,
    ZeroRedundancyOptimizer,
    hook_with_zero_step_interleaved,
)

IMPLS = ["torch-ddp-adamw", "torch-ddp-zero1", "shardwise-ddp-zero1", "shardwise-zero2",
         "shardwise-zero1-overlap", "local-adamw"]
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def _model_args(parser) -> None:
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)


def _build(impl: str, model: torch.nn.Module, args, group):
    cap = args.bucket_cap_mb
    if impl == "torch-ddp-adamw":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                            bucket_cap_mb=cap)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), **ADAMW)
    if impl == "torch-ddp-zero1":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                            bucket_cap_mb=cap)
        return wrapped, TorchZero(wrapped.parameters(), optimizer_class=torch.optim.AdamW,
                                  process_group=group, **ADAMW)
    if impl == "shardwise-ddp-zero1":
        wrapped = DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap)
        return wrapped, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                process_group=group, **ADAMW)
    if impl == "shardwise-zero1-overlap":
        wrapped = DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group,
                                      overlap_with_ddp=True, **ADAMW)
        wrapped.register_comm_hook(group, hook_with_zero_step_interleaved(
            default_hooks.allreduce_hook, wrapped, opt))
        return wrapped, _NoStep(opt)
    if impl == "local-adamw":
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    if impl == "shardwise-zero2":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                      process_group=group, **ADAMW)
        return ZeroDataParallel(model, opt, bucket_cap_mb=cap), opt
    raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")


class _NoStep:
    """overlap_with_ddp steps inside backward: the loop's step() is left out (zero_grad stays)."""

    def __init__(self, opt):
        self.opt = opt

    def step(self):
        return None

    def zero_grad(self, set_to_none: bool = True):
        self.opt.zero_grad(set_to_none=set_to_none)


def worker(impl: str, args, group: dist.ProcessGroup):
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg).to(bench_device(args))
    wrapped, opt = _build(impl, model, args, group)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    exposed = exposed_comm_probe(wrapped, args.warmup)
    times = timed_steps(wrapped, opt, stream, args, group, after_step=exposed.record)
    x, y = (t.to(bench_device(args)) for t in stream.batch(0))
    lm_loss(wrapped(x), y).backward()
    real_opt = getattr(opt, "opt", opt)
    held = state_bytes(model, real_opt).as_mib()  # after backward: gradients as a step sees them
    opt.step()
    return times, {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                   **{f"{k}_MiB": round(v, 1) for k, v in held.items()}, **exposed.summary()}


BENCH = SideBySide("zero", worker, IMPLS, "torch-ddp-zero1", _model_args,
                   "ZeRO stages 1 and 2 against torch's ZeroRedundancyOptimizer",
                   limit_of="local-adamw",
                   pattern=PATTERNS["zero"])
