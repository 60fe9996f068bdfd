"""Our FSDP against torch's fully_shard (FSDP2), with our DDP and torch's DDP for scale.

The demo GPT with one unit per transformer block (the root owning embeddings, final norm and
head), each rank its slice of a global batch from the stdlib corpus, AdamW, fp32, CPU + gloo.
Every implementation runs in fresh ranks, rounds interleaved (see shardwise/bench/sidebyside.py).
``local-fsdp`` has no wrapper and no communication: each rank runs the whole model's forward
and backward on its slice of the batch and AdamW over 1/world of the elements (what one FSDP
rank computes), then measures the communication FSDP's pattern cannot overlap: the root unit's
all-gather and reduce-scatter (limits.py). Its step plus that is the limit of both FSDP rows
(and of torch's).

    shardwise bench fsdp --nproc 2 --rounds 3 --steps 10
    shardwise bench fsdp --mmap-threshold     # peak RSS that tracks live memory
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from shardwise.bench.gpt_steps import batch_stream, timed_steps
from shardwise.bench.limits import PATTERNS, ShardedStepStandIn, fsdp_pattern_ms, root_numel
from shardwise.bench.sidebyside import SideBySide, bench_device
from shardwise.ddp import DistributedDataParallel
from shardwise.fsdp import fully_shard, units_of
from shardwise.memory import state_bytes
from shardwise.models import GPT, GPTConfig

IMPLS = ["torch-fsdp2", "shardwise-fsdp", "shardwise-fsdp-noprefetch", "shardwise-ddp",
         "torch-ddp", "local-fsdp"]
PATTERN = PATTERNS["fsdp"]


def _model_args(parser) -> None:
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="global batch")
    parser.add_argument("--no-reshard", action="store_true",
                        help="reshard_after_forward=False for both FSDPs")


def _wrap(impl: str, model: GPT, group: dist.ProcessGroup, reshard: bool):
    if impl == "torch-fsdp2":
        from torch.distributed.device_mesh import DeviceMesh

        from shardwise._compat import torch_fully_shard

        torch_shard = torch_fully_shard()
        mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
        for block in model.blocks:
            torch_shard(block, mesh=mesh, reshard_after_forward=reshard)
        return torch_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if impl.startswith("shardwise-fsdp"):
        for block in model.blocks:
            fully_shard(block, process_group=group, reshard_after_forward=reshard)
        return fully_shard(model, process_group=group, reshard_after_forward=reshard,
                           forward_prefetch=not impl.endswith("-noprefetch"))
    if impl == "local-fsdp":
        return model
    if impl == "torch-ddp":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    return DistributedDataParallel(model, process_group=group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_mib(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    opt_tensors = [_local(v) for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor)]
    with warnings.catch_warnings():  # state_bytes looks at .grad of the tensors it is given
        warnings.simplefilter("ignore")
        total = sum(state_bytes(ts).params for ts in (params, grads, opt_tensors))
    return round(total / 2**20, 1)


def host_shared_mib(model: torch.nn.Module) -> float:
    """MiB of our units' parameters held in mappings shared by the ranks of one host ([Note:
    parameters shared on one host]): every rank maps and reads them all, so its peak RSS counts
    them whole although the host holds them once."""
    handles = [u.handle for u in units_of(model) if u.handle is not None]
    return round(sum(h.host.segment.nbytes for h in handles if h.host is not None) / 2**20, 1)


def worker(impl: str, args, group: dist.ProcessGroup):
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    torch.manual_seed(0)
    device = bench_device(args)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    wrapped = _wrap(impl, model, group, not args.no_reshard)
    if impl == "local-fsdp":
        opt = ShardedStepStandIn(model, dist.get_world_size(group), device)
    else:
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    state = {}

    def measure(step: int) -> None:  # on the last warm-up step, so that no timed step pays
        if step == max(args.warmup - 1, 0):
            state["MiB"] = _state_mib(model, opt)  # between steps: params + grads + AdamW state

    times = timed_steps(wrapped, opt, stream, args, group,
                        after_step=None if impl == "local-fsdp" else measure)
    extra = {"params_M": round(n_params / 1e6, 2)}
    if impl == "local-fsdp":
        extra["pattern_comm_ms"] = fsdp_pattern_ms(root_numel(model), group, device)
    else:
        extra["state_MiB"] = state.get("MiB", 0.0)
        if impl.startswith("shardwise-fsdp"):
            extra["host_shared_MiB"] = host_shared_mib(model)
    return times, extra


BENCH = SideBySide("fsdp", worker, IMPLS, "torch-fsdp2", _model_args,
                   "FSDP against torch's fully_shard (FSDP2)",
                   limit_rows={"torch-fsdp2": "local-fsdp", "shardwise-fsdp": "local-fsdp",
                               "shardwise-fsdp-noprefetch": "local-fsdp"},
                   pattern=PATTERN)
