"""HSDP and FULL_SHARD: our fully_shard against torch's FSDP2 ``fully_shard(mesh=...)`` on the
same meshes.

HSDP is a (replicate, shard) = (``--replicas``, nproc / replicas) mesh, FULL_SHARD a 1D mesh over
every rank; both FSDPs get the same mesh built the same way (torch's ``init_device_mesh`` for
torch, ours for ours: identical rank layouts). The demo GPT with one unit per transformer block,
AdamW, fp32, CPU + gloo, each rank its slice of a global batch; every implementation in fresh
ranks, rounds interleaved (sidebyside.py). Prints the table, then for each mesh our step time
over torch's and both peak RSS per rank.

    python benchmarks/bench_mesh.py --rounds 3 --steps 10      # --nproc 4 --replicas 2
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpt_steps import batch_stream, timed_steps

import sidebyside
from bench_fsdp import _model_args, _state_mib
from shardwise import fully_shard
from shardwise.models import GPT, GPTConfig

IMPLS = ["torch-fsdp2-hsdp", "shardwise-hsdp", "torch-fsdp2-full", "shardwise-full"]
PAIRS = [("shardwise-hsdp", "torch-fsdp2-hsdp"), ("shardwise-full", "torch-fsdp2-full")]


def _args(parser) -> None:
    _model_args(parser)
    parser.add_argument("--replicas", type=int, default=2, help="HSDP replicas (mesh dim 0)")
    parser.set_defaults(nproc=4, batch_size=4)  # 2 x 2 for HSDP: one sample per rank


def _mesh(impl: str, args, group: dist.ProcessGroup):
    world = dist.get_world_size(group)
    if impl.endswith("-full"):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu")
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide --nproc {world}")
    shape, names = (args.replicas, world // args.replicas), ("replicate", "shard")
    if impl.startswith("torch"):
        from torch.distributed.device_mesh import init_device_mesh
    else:
        from shardwise.distributed import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _wrap(impl: str, model: GPT, mesh, reshard: bool):
    if impl.startswith("torch"):
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh, reshard_after_forward=reshard)
    return shard(model, mesh=mesh, reshard_after_forward=reshard)


def worker(impl: str, args, group: dist.ProcessGroup):
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    wrapped = _wrap(impl, model, _mesh(impl, args, group), not args.no_reshard)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    state = {}

    def measure(step: int) -> None:
        if step == max(args.warmup - 1, 0):
            state["MiB"] = _state_mib(model, opt)

    times = timed_steps(wrapped, opt, stream, args, group, after_step=measure)
    return times, {"state_MiB": state.get("MiB", 0.0)}


def compare(summary: dict) -> str:
    lines = []
    for ours, theirs in PAIRS:
        if ours not in summary or theirs not in summary:
            continue
        a, b = summary[ours], summary[theirs]
        ratio = a["median_step_s"] / b["median_step_s"]
        higher = [k for k, (m, t) in enumerate(zip(a["peak_rss_mib"], b["peak_rss_mib"]))
                  if m > t]
        lines.append(f"{ours} / {theirs}: step time {ratio:.3f}x (bar <= 0.7); peak RSS per rank "
                     f"{'/'.join(f'{m:.0f}' for m in a['peak_rss_mib'])} vs "
                     f"{'/'.join(f'{m:.0f}' for m in b['peak_rss_mib'])} MiB"
                     + (f" (higher on ranks {higher})" if higher else " (no rank higher)"))
    return "\n".join(lines)


if __name__ == "__main__":
    result = sidebyside.main(worker, IMPLS, baseline="torch-fsdp2-full", extra=_args)
    if result:
        print(compare(result))
