"""Our DistributedDataParallel against torch's, on the default model of `shardwise train`.

Same model (the demo GPT at `shardwise train`'s defaults unless told otherwise), same data
(the stdlib corpus, each rank its slice of a global batch), same world size, same AdamW.

    shardwise bench ddp --nproc 2 --rounds 3 --steps 20
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.bench.gpt_steps import batch_stream, timed_steps
from shardwise.bench.sidebyside import SideBySide
from shardwise.ddp import DistributedDataParallel
from shardwise.memory import state_bytes
from shardwise.models import GPT, GPTConfig

IMPLS = ["torch-ddp", "shardwise-ddp"]


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
    model = GPT(cfg)
    if impl == "torch-ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=args.bucket_cap_mb)
    else:
        wrapped = DistributedDataParallel(model, process_group=group,
                                          bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    times = timed_steps(wrapped, opt, stream, args, group)
    nbytes = state_bytes(model, opt)
    return times, {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                   "state_MiB": round(nbytes.total / 2**20, 1)}


BENCH = SideBySide("ddp", worker, IMPLS, "torch-ddp", _model_args,
                   "DDP: ours against torch's DistributedDataParallel")
