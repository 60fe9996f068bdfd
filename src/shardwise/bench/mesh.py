"""HSDP and FULL_SHARD: our fully_shard against torch's FSDP2 ``fully_shard(mesh=...)`` on the
same meshes.

HSDP is a (replicate, shard) = (``--replicas``, nproc / replicas) mesh, FULL_SHARD a 1D mesh over
every rank; both FSDPs get the same mesh built the same way (torch's ``init_device_mesh`` for
torch, ours for ours: identical rank layouts). The demo GPT with one unit per transformer block,
AdamW, fp32, CPU + gloo, each rank its slice of a global batch; every implementation in fresh
ranks, rounds interleaved (sidebyside.py). Prints the table, then for each mesh our step time
over torch's and both peak RSS per rank (kept in the record as ``comparison``).
``local-hsdp`` and ``local-full`` have no wrapper and no communication (each rank: the whole
model's forward and backward, AdamW over 1/shard of the elements) and measure what each mesh's
pattern cannot overlap, for the limit of both implementations on that mesh (limits.py).

    shardwise bench mesh --rounds 3 --steps 10      # --nproc 4 --replicas 2
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.bench.fsdp import _model_args, _state_mib, host_shared_mib
from shardwise.bench.gpt_steps import batch_stream, timed_steps
from shardwise.bench.limits import PATTERNS, ShardedStepStandIn, fsdp_pattern_ms, root_numel
from shardwise.bench.sidebyside import SideBySide, bench_device
from shardwise.bench.sidebyside import run as run_side_by_side
from shardwise.fsdp import fully_shard
from shardwise.models import GPT, GPTConfig

IMPLS = ["torch-fsdp2-hsdp", "shardwise-hsdp", "torch-fsdp2-full", "shardwise-full",
         "local-hsdp", "local-full"]
LIMIT_ROWS = {"torch-fsdp2-hsdp": "local-hsdp", "shardwise-hsdp": "local-hsdp",
              "torch-fsdp2-full": "local-full", "shardwise-full": "local-full"}
PATTERN = PATTERNS["mesh"]
PAIRS = [("shardwise-hsdp", "torch-fsdp2-hsdp"), ("shardwise-full", "torch-fsdp2-full")]


def _args(parser) -> None:
    _model_args(parser)
    parser.add_argument("--replicas", type=int, default=2, help="HSDP replicas (mesh dim 0)")
    parser.set_defaults(nproc=4, batch_size=4)  # 2 x 2 for HSDP: one sample per rank


def _mesh(impl: str, args, group: dist.ProcessGroup):
    world = dist.get_world_size(group)
    kind = bench_device(args).type
    if impl.endswith("-full"):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, kind)
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide --nproc {world}")
    shape, names = (args.replicas, world // args.replicas), ("replicate", "shard")
    if impl.startswith("torch"):
        from torch.distributed.device_mesh import init_device_mesh
    else:
        from shardwise.distributed import init_device_mesh
    return init_device_mesh(kind, shape, mesh_dim_names=names)


def _wrap(impl: str, model: GPT, mesh, reshard: bool):
    if impl.startswith("torch"):
        from shardwise._compat import torch_fully_shard

        shard = torch_fully_shard()
    else:
        shard = fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh, reshard_after_forward=reshard)
    return shard(model, mesh=mesh, reshard_after_forward=reshard)


def worker(impl: str, args, group: dist.ProcessGroup):
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg).to(bench_device(args))
    mesh = _mesh(impl, args, group)
    if impl.startswith("local"):
        return _local_worker(impl, model, mesh, cfg, args, group)
    wrapped = _wrap(impl, model, mesh, not args.no_reshard)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    state = {}

    def measure(step: int) -> None:
        if step == max(args.warmup - 1, 0):
            state["MiB"] = _state_mib(model, opt)

    times = timed_steps(wrapped, opt, stream, args, group, after_step=measure)
    extra = {"state_MiB": state.get("MiB", 0.0)}
    if impl.startswith("shardwise"):
        extra["host_shared_MiB"] = host_shared_mib(model)
    return times, extra


def _local_worker(impl: str, model: GPT, mesh, cfg: GPTConfig, args, group):
    """No wrapper, no communication in the step; then the mesh pattern's exposed part."""
    device = bench_device(args)
    if impl == "local-full":
        shard_group, replicate_group = group, None
    else:
        shard_group, replicate_group = mesh.get_group("shard"), mesh.get_group("replicate")
    opt = ShardedStepStandIn(model, dist.get_world_size(shard_group), device)
    stream = batch_stream(cfg.seq_len, args.batch_size, group)
    times = timed_steps(model, opt, stream, args, group)
    ms = fsdp_pattern_ms(root_numel(model), shard_group, device, replicate_group)
    return times, {"pattern_comm_ms": ms}


def comparison(summary: dict) -> list[dict]:
    """Per mesh whose both implementations ran: our median step over torch's, both peak RSS per
    rank, and the ranks where ours is higher."""
    rows = []
    for ours, theirs in PAIRS:
        if ours not in summary or theirs not in summary:
            continue
        a, b = summary[ours], summary[theirs]
        rows.append({"ours": ours, "torch": theirs,
                     "step_ratio": a["median_step_s"] / b["median_step_s"],
                     "ours_peak_rss_mib": a["peak_rss_mib"],
                     "torch_peak_rss_mib": b["peak_rss_mib"],
                     "higher_ranks": [k for k, (m, t) in enumerate(zip(a["peak_rss_mib"],
                                                                        b["peak_rss_mib"]))
                                      if m > t]})
    return rows


def comparison_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        higher = row["higher_ranks"]
        lines.append(f"{row['ours']} / {row['torch']}: step time {row['step_ratio']:.3f}x "
                     f"(bar <= 0.7); peak RSS per rank "
                     f"{'/'.join(f'{m:.0f}' for m in row['ours_peak_rss_mib'])} vs "
                     f"{'/'.join(f'{m:.0f}' for m in row['torch_peak_rss_mib'])} MiB"
                     + (f" (higher on ranks {higher})" if higher else " (no rank higher)"))
    return lines


_BENCH = SideBySide("mesh", worker, IMPLS, "torch-fsdp2-full", _args,
                    "HSDP and FULL_SHARD against torch's fully_shard(mesh=...)",
                    limit_rows=LIMIT_ROWS, pattern=PATTERN)


def run(argv: Sequence[str]) -> dict | None:
    """The side-by-side run, plus the ours/torch comparison per mesh (printed after the
    table as the record's ``notes``)."""
    record = run_side_by_side(_BENCH, argv)
    if record is None:
        return None
    rows = comparison(record["impls"])
    return {**record, "comparison": rows, "notes": comparison_lines(rows)}
