"""Our DistributedDataParallel against torch's, on the default model of `shardwise train`.

Same model (the demo GPT at `shardwise train`'s defaults unless told otherwise), same data
(the stdlib corpus, each rank its slice of a global batch), same world size, same AdamW.
Besides plain DDP: PowerSGD (rank 1, from step 2) on both DDPs, with our
``shardwise.ddp.hooks.powerSGD_hook``: torch's own hook, on torch's DDP as on ours, issues its
second all-reduce from a callback and on gloo with several buckets the ranks' collectives
mismatch (gloo aborts; see [Note: PowerSGD's second all-reduce]); and torch's
``bf16_compress_hook`` on both (torch's DDP calls it through ``bf16_hook``, as it refuses the
hook by name without CUDA and NCCL; ours is given the hook itself). ``local-adamw`` has no
wrapper and no communication (each rank's world-size-1 step); rows of ours are then also
compared with that step plus the communication they left exposed (the physical limit).

    shardwise bench ddp --nproc 2 --rounds 3 --steps 20
    shardwise bench ddp --n-layer 4 --d-model 512 --n-head 8 --seq-len 64 \
        --batch-size 8 --only torch-ddp,shardwise-ddp,local-adamw   # bench zero's model
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardwise.bench.gpt_steps import batch_stream, exposed_comm_probe, timed_steps
from shardwise.bench.limits import PATTERNS
from shardwise.bench.sidebyside import SideBySide, bench_device
from shardwise.ddp import DistributedDataParallel, hooks
from shardwise.memory import state_bytes
from shardwise.models import GPT, GPTConfig

IMPLS = ["torch-ddp", "shardwise-ddp", "torch-ddp-powersgd", "shardwise-ddp-powersgd",
         "torch-ddp-bf16", "shardwise-ddp-bf16", "local-adamw"]


@dataclass(frozen=True)
class _Defaults:  # `shardwise train`'s defaults (kept in step by tests/bench)
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    seq_len: int = 128
    batch_size: int = 16


def _model_args(parser) -> None:
    d = _Defaults()
    parser.add_argument("--n-layer", type=int, default=d.n_layer)
    parser.add_argument("--d-model", type=int, default=d.d_model)
    parser.add_argument("--n-head", type=int, default=d.n_head)
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)


def worker(impl: str, args, group: dist.ProcessGroup):
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg).to(bench_device(args))
    wrapped = _wrap(impl, model, args, group)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    exposed = exposed_comm_probe(wrapped, args.warmup)
    times = timed_steps(wrapped, opt, stream, args, group, after_step=exposed.record)
    nbytes = state_bytes(model, opt)
    return times, {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                   "state_MiB": round(nbytes.total / 2**20, 1), **exposed.summary()}


def _wrap(impl: str, model: torch.nn.Module, args, group) -> torch.nn.Module:
    if impl == "local-adamw":
        return model
    cls = (torch.nn.parallel.DistributedDataParallel if impl.startswith("torch")
           else DistributedDataParallel)
    wrapped = cls(model, process_group=group, bucket_cap_mb=args.bucket_cap_mb)
    if impl.endswith("-powersgd"):
        state = hooks.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                    start_powerSGD_iter=2)
        wrapped.register_comm_hook(state, hooks.powerSGD_hook)
    elif impl.endswith("-bf16"):  # ours takes torch's hook itself (on one host it runs as
        # its arithmetic on the shared-memory path: [Note: compression on one host])
        wrapped.register_comm_hook(group, bf16_hook if impl.startswith("torch")
                                   else default_hooks.bf16_compress_hook)
    return wrapped


def bf16_hook(state, bucket):  # unannotated: torch checks annotations by value
    """torch's own ``bf16_compress_hook``, called through a function of another name: torch's
    DDP refuses that hook by its name unless CUDA and NCCL are present, though gloo on CPU
    all-reduces bfloat16; both DDPs run this same function."""
    return default_hooks.bf16_compress_hook(state, bucket)

BENCH = SideBySide("ddp", worker, IMPLS, "torch-ddp", _model_args,
                   "DDP: ours against torch's DistributedDataParallel", limit_of="local-adamw",
                   pattern=PATTERNS["ddp"])
