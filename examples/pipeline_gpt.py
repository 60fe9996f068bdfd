"""Pipeline-parallel training of the demo GPT with shardwise.rpc, checked against the unsplit model.

worker0 drives; worker1 and worker2 each hold one stage of the GPT. Micro-batches flow
stage to stage by ``remote()`` (each stage fetches its input from the previous one), the loss is
computed on worker0, ``dist_autograd.backward`` sends gradients back through every RPC, and a
``DistributedOptimizer`` steps each stage's parameters in place on their owner. The same steps
run on an unsplit copy of the model and both losses are printed side by side.

    python examples/pipeline_gpt.py [--steps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket

import torch

import shardwise.rpc as rpc
from shardwise.cli.strategy_pipeline import PipelineModel, split_gpt
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.rpc import autograd as dist_autograd

CFG = GPTConfig(n_layer=4, n_head=2, d_model=64, seq_len=32)
STAGES = 2


def make_stage(index: int, seed: int):
    torch.manual_seed(seed)
    return split_gpt(GPT(CFG), STAGES)[index]


def stage_params(stage_rref: rpc.RRef) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in stage_rref.local_value().parameters()]


def drive(steps: int, seed: int = 0) -> None:
    stages = [rpc.remote(f"worker{i + 1}", make_stage, args=(i, seed)) for i in range(STAGES)]
    pipe = PipelineModel(stages, micro_batches=4)
    params = [p for s in stages for p in rpc.rpc_sync(s.owner(), stage_params, args=(s,))]
    opt = rpc.DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    torch.manual_seed(seed)
    reference = GPT(CFG)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=data)
        x, y = x[:, :-1], x[:, 1:]
        with dist_autograd.context() as cid:
            loss = lm_loss(pipe(x), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        print(f"step {step}: pipeline loss {loss.item():.6f}  unsplit {ref_loss.item():.6f}  "
              f"rel diff {rel:.1e}")


def _worker(rank: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=STAGES + 1, rpc_backend_options=opts)
    if rank == 0:
        drive(steps)
    rpc.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    steps = ap.parse_args().steps
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, steps)) for r in range(STAGES + 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
