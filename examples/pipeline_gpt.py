"""Pipeline-parallel training of the demo GPT with shardwise.pipeline, checked against the
unsplit model.

Two processes, one stage each (the GPT cut by ``split_gpt``: embeddings and the first blocks, then
the last blocks, ``ln_f`` and the head). Every step cuts the batch into 4 micro-batches that flow
through the stages on a GPipe or 1F1B schedule, over c10d point-to-point (``--transport p2p``) or
over RPC with distributed autograd (``--transport rpc``); each stage steps its own optimizer.
The last stage also trains an unsplit copy of the model on the same batches and prints both
losses side by side.

    python examples/pipeline_gpt.py [--steps 5] [--schedule 1f1b] [--transport rpc]
    shardwise run --nproc 2 examples/pipeline_gpt.py [...]

Run plainly, it starts its two processes itself; under a launcher (torchrun, ``shardwise run``:
RANK and WORLD_SIZE set) each launched process is one stage, and the launcher's store is the
rendezvous. Exits non-zero if a pipeline loss differs from the unsplit model's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket

import torch
import torch.distributed as dist

import shardwise.rpc as rpc
from shardwise.distributed import init, launched
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, split_gpt

CFG = GPTConfig(n_layer=4, n_head=2, d_model=64, seq_len=32)
STAGES, MICRO_BATCHES, BATCH = 2, 4, 8
TOLERANCE = 1e-4  # relative difference allowed between the pipeline's and the unsplit loss


def batches(steps: int):
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=data)
        yield x[:, :-1], x[:, 1:]


def run(rank: int, steps: int, schedule: str, transport: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    module = split_gpt(GPT(CFG), STAGES)[rank]
    stage = PipelineStage(module, rank, STAGES, transport=transport)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    pipe = cls(stage, MICRO_BATCHES, loss_fn=lm_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    if stage.is_last:
        torch.manual_seed(seed)
        reference = GPT(CFG)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(steps)):
        losses: list[torch.Tensor] = []
        if stage.is_first:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad()
        if stage.is_last:
            loss = torch.stack(losses).mean().item()
            ref_loss = lm_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            rel = abs(loss - ref_loss.item()) / abs(ref_loss.item())
            idle = stage.stats.idle_fraction  # None over RPC (backward runs in RPC threads)
            shown = f"  (last stage idle {idle:.2f})" if idle is not None else ""
            print(f"step {step}: pipeline loss {loss:.6f}  unsplit {ref_loss.item():.6f}  "
                  f"rel diff {rel:.1e}{shown}")
            if not rel <= TOLERANCE:
                raise SystemExit(f"step {step}: the pipeline's loss differs from the unsplit "
                                 f"model's by {rel:.1e} (allowed {TOLERANCE:g})")
    if stage.is_last:
        print(f"ok: {steps} steps, the pipeline's losses equal the unsplit model's "
              f"({schedule}, {transport})")


def _worker(rank: int, ports: tuple[int, int], args: argparse.Namespace) -> None:
    """One stage, started by main() below: it rendezvouses at the ports main() chose."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=STAGES)
    if args.transport == "rpc":  # RPC ranks equal the c10d ranks
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[1]}")
        rpc.init_rpc(f"stage{rank}", rank=rank, world_size=STAGES, rpc_backend_options=opts)
    _stage(rank, args)


def _launched_stage(args: argparse.Namespace) -> None:
    """One stage, started by a launcher: its environment says the rank and the rendezvous."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != STAGES:
        raise SystemExit(f"pipeline_gpt.py has {STAGES} stages: launch it with --nproc "
                         f"{STAGES}, not {world_size}")
    init()
    rank = dist.get_rank()
    if args.transport == "rpc":  # env://: the launcher's store, shared with the process group
        rpc.init_rpc(f"stage{rank}", rank=rank, world_size=STAGES)
    _stage(rank, args)


def _stage(rank: int, args: argparse.Namespace) -> None:
    run(rank, args.steps, args.schedule, args.transport)
    dist.barrier()
    if args.transport == "rpc":
        rpc.shutdown()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--transport", choices=["p2p", "rpc"], default="p2p")
    args = ap.parse_args()
    if launched():
        _launched_stage(args)
        return
    ports = (_free_port(), _free_port())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, ports, args)) for r in range(STAGES)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a stage failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
