"""Our sharded checkpoint against torch.distributed.checkpoint (DCP) on one fully_shard model.

The demo GPT (default: 4 layers, d_model 1024, ~51M parameters, as bench_fsdp.py) sharded by
shardwise.fully_shard (one unit per block, Shard(0) DTensors), AdamW state created; the same
state dict ({"model": ..., "optim": ...} from shardwise.checkpoint.get_state_dict, parameters
and AdamW state as DTensors keyed by name) is saved and loaded by both, in one run of fresh
ranks, rounds interleaved (DCP, ours, DCP, ours, ...):

- save: ``dcp.save`` / ``shardwise.checkpoint.save`` (both fsync their files), slowest rank
- load: ``dcp.load`` / ``shardwise.checkpoint.load`` into the same DTensors, in place
- async stall: time until ``async_save`` returns (training could go on), and until done
- DCP's async_save is given DTensors with their own local tensors (see ``_dcp_stageable``;
  its stager cannot copy views into FSDP's flat shard), cloned before the timed region
- peak memory per rank: growth of peak RSS (VmHWM reset before each phase; glibc's mmap
  threshold lowered so freed blocks leave RSS)

    python benchmarks/bench_checkpoint.py --nproc 2 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024 * 1024
IMPLS = ("torch-dcp", "shardwise")
PHASES = ("save", "load", "async_stall", "async_total")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    gc.collect()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _dcp_stageable(state):
    """A copy of ``state`` whose DTensors own their local tensors: torch DCP's async stager
    fails ("invalid python storage") on DTensors whose local tensor is a view at a nonzero
    offset of a larger buffer, as shardwise's FSDP shards are. Made outside the timed region."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _dcp_stageable(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_dcp_stageable(v) for v in state]
    if isinstance(state, DTensor):
        return DTensor.from_local(state._local_tensor.clone(), state.device_mesh,
                                  state.placements, run_check=False, shape=state.shape,
                                  stride=state.stride())
    return state


def _ops(impl: str, async_group):
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as ours

    if impl == "torch-dcp":
        return (lambda s, p: dcp.save(s, checkpoint_id=p),
                lambda s, p: dcp.load(s, checkpoint_id=p),
                lambda s, p: dcp.async_save(s, checkpoint_id=p, process_group=async_group))
    return (lambda s, p: ours.save(s, checkpoint_id=p),
            lambda s, p: ours.load(s, checkpoint_id=p),
            lambda s, p: ours.async_save(s, checkpoint_id=p))


def _timed(group, fn, *args) -> tuple[float, int, object]:
    import torch
    import torch.distributed as dist

    dist.barrier(group)
    base = _reset_peak()
    start = time.perf_counter()
    out = fn(*args)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return float(took), _status("VmHWM") - base, out


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardwise.distributed as sd
    from shardwise import fully_shard
    from shardwise.checkpoint import get_state_dict
    from shardwise.models import GPT, GPTConfig

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group = sd.init()
    rank = dist.get_rank(group)
    async_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head))
    n_params = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, process_group=group)
    fully_shard(model, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    root = Path(args.dir)
    records = {impl: {ph: [] for ph in PHASES} | {"mem_" + ph: [] for ph in PHASES}
               for impl in IMPLS}
    for rnd in range(args.rounds):
        for impl in IMPLS:
            path = root / f"{impl}-{rnd}"
            _one_round(impl, state, path, group, async_group, records[impl])
            dist.barrier(group)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(Path(f"{path}-async"), ignore_errors=True)
            dist.barrier(group)
    out = {"rank": rank, "params_M": round(n_params / 1e6, 2), "records": records}
    (root / f"record.rank{rank}.json").write_text(json.dumps(out))
    sd.destroy()


def _one_round(impl: str, state: dict, path: Path, group, async_group, rec: dict) -> None:
    import torch
    import torch.distributed as dist

    save, load, async_save = _ops(impl, async_group)
    t, m, _ = _timed(group, save, state, path)
    rec["save"].append(t)
    rec["mem_save"].append(m)
    t, m, _ = _timed(group, load, state, path)
    rec["load"].append(t)
    rec["mem_load"].append(m)
    staged = _dcp_stageable(state) if impl == "torch-dcp" else state
    start = time.perf_counter()
    t, m, fut = _timed(group, async_save, staged, Path(f"{path}-async"))
    rec["async_stall"].append(t)
    rec["mem_async_stall"].append(m)
    fut.result()
    total = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    rec["async_total"].append(float(total))
    rec["mem_async_total"].append(_status("VmHWM") - _status("VmRSS"))


def _report(args: argparse.Namespace, root: Path) -> None:
    recs = [json.loads((root / f"record.rank{r}.json").read_text()) for r in range(args.nproc)]
    print(f"world size {args.nproc}, {args.rounds} rounds interleaved, demo GPT "
          f"{recs[0]['params_M']}M parameters + AdamW state, shardwise.fully_shard, gloo CPU")
    print(f"{'phase':<14}{'torch DCP (s)':>15}{'shardwise (s)':>15}{'ratio':>8}   "
          "peak RSS growth per rank, MiB: DCP | shardwise")
    for ph in PHASES:
        med = {i: statistics.median(recs[0]["records"][i][ph]) for i in IMPLS}
        mem = {i: " / ".join(f"{max(r['records'][i]['mem_' + ph]) / MIB:.0f}" for r in recs)
               for i in IMPLS}
        ratio = med["shardwise"] / med["torch-dcp"]
        print(f"{ph:<14}{med['torch-dcp']:>15.3f}{med['shardwise']:>15.3f}{ratio:>8.2f}   "
              f"{mem['torch-dcp']} | {mem['shardwise']}")


def main() -> None:
    args = _args()
    if args.worker:
        _worker(args)
        return
    from shardwise.launch import launch

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    root.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, sys.argv[0], *sys.argv[1:], "--dir", str(root), "--worker", "1"]
    try:
        code = launch(args.nproc, argv)
        if code:
            raise SystemExit(f"benchmark ranks failed (exit code {code})")
        _report(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
