"""Test bodies run on every rank of the pool (importable by the workers)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import shardwise.rpc as rpc
from shardwise import DistributedDataParallel
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    pipeline_layout,
    split_gpt,
)
from tests.harness import rank_slice, reference_train, token_batch

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)
BATCH, STEPS, LR = 8, 5, 3e-3
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step, 1, BATCH, CFG.seq_len, CFG.vocab_size)
    return x[0], y[0]


def reference_losses() -> list[float]:
    """The unsplit model, one process, the whole batch, AdamW."""
    def loss(model, step):
        x, y = batch(step)
        return lm_loss(model(x), y)

    return reference_train(lambda: GPT(CFG), loss,
                           lambda m: torch.optim.AdamW(m.parameters(), lr=LR), STEPS).losses


@contextlib.contextmanager
def rpc_agents(ctx):
    """An RPC agent per pool rank (RPC rank = global rank), through a store rank 0 hosts."""
    port = torch.zeros(1, dtype=torch.int64)
    store = None
    if ctx.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, ctx.world_size, is_master=True,
                              wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, src=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", int(port), ctx.world_size, is_master=False)
    opts = rpc.TensorPipeRpcBackendOptions(store=store, rpc_timeout=60)
    rpc.init_rpc(f"worker{ctx.rank}", rank=ctx.rank, world_size=ctx.world_size,
                 rpc_backend_options=opts)
    try:
        yield
    finally:
        rpc.shutdown()


def make_stage(ctx, pp: int, transport: str, dp_wrap: bool = True, measure: bool = False):
    layout = pipeline_layout(pp)
    torch.manual_seed(0)
    module = split_gpt(GPT(CFG), pp)[layout.stage_index]
    if layout.dp > 1 and dp_wrap:
        module = DistributedDataParallel(module, process_group=layout.dp_group)
    stage = PipelineStage(module, layout.stage_index, pp, group=layout.pp_group,
                          transport=transport, measure_activations=measure)
    return layout, module, stage


@contextlib.contextmanager
def counting_all_reduces(counter: list):
    """Count torch.distributed.all_reduce calls (DDP's bucket reductions) inside the block."""
    real = dist.all_reduce

    def counted(*args, **kwargs):
        counter.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = real


def train_losses(ctx, pp: int, schedule: str, transport: str, micro: int = 4) -> dict:
    """5 AdamW steps of the pipelined GPT; the last stage of each replica reports its losses
    (each micro-batch's mean loss, averaged: the replica's batch loss), every rank the number of
    all-reduces its DDP ran (dp > 1)."""
    reductions: list = []
    with rpc_agents(ctx) if transport == "rpc" else contextlib.nullcontext(), \
            counting_all_reduces(reductions):
        layout, module, stage = make_stage(ctx, pp, transport)
        sched = SCHEDULES[schedule](stage, micro, loss_fn=lm_loss)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            x, y = rank_slice(x, layout.replica, layout.dp), rank_slice(y, layout.replica,
                                                                        layout.dp)
            got: list = []
            if stage.is_first and stage.is_last:
                sched.step(x, target=y, losses=got)
            elif stage.is_first:
                sched.step(x)
            elif stage.is_last:
                sched.step(target=y, losses=got)
            else:
                sched.step()
            opt.step()
            opt.zero_grad()
            if got:
                losses.append(torch.stack(got).mean().item())
        if transport == "rpc":
            dist.barrier()  # every stage done with its RPCs before the agents stop
        return {"replica": layout.replica, "last": stage.is_last, "losses": losses,
                "all_reduces": _reductions(module, reductions),
                "peak_activation_bytes": stage.stats.peak_activation_bytes}


def _reductions(module, all_reduces: list) -> int:
    """Gradient reductions DDP ran (through gloo or, on one host, shared memory: counted by its
    bucketer); without DDP, the all-reduce calls seen (there should be none)."""
    if isinstance(module, DistributedDataParallel):
        return module.reducer.reductions
    return len(all_reduces)


def activation_peaks(ctx, transport: str, micro: int = 8) -> dict:
    """Peak saved-activation bytes of this stage for one step of each schedule."""
    pp = ctx.world_size
    with rpc_agents(ctx) if transport == "rpc" else contextlib.nullcontext():
        _, _, stage = make_stage(ctx, pp, transport, measure=True)
        peaks = {}
        x, y = token_batch(0, 1, 16, CFG.seq_len, CFG.vocab_size)
        for name, cls in SCHEDULES.items():
            sched = cls(stage, micro, loss_fn=lm_loss)
            args = (x[0],) if stage.is_first else ()
            sched.step(*args, target=y[0] if stage.is_last else None, return_outputs=False)
            peaks[name] = stage.stats.peak_activation_bytes
            peaks[name + "_live_after"] = stage.meter.live_bytes
            peaks[name + "_idle"] = stage.stats.idle_fraction
        if transport == "rpc":
            dist.barrier()
        return {"stage": stage.stage_index, **peaks}


def bad_stage_count(ctx) -> str:
    torch.manual_seed(0)
    module = split_gpt(GPT(CFG), 2)[0]
    try:
        PipelineStage(module, 0, ctx.world_size + 1)
    except ValueError as exc:
        return str(exc)
    return "no error"


def bad_microbatches(ctx) -> str:
    _, _, stage = make_stage(ctx, ctx.world_size, "p2p")
    sched = ScheduleGPipe(stage, 3, loss_fn=lm_loss)
    x, y = batch(0)
    try:
        if stage.is_first:
            sched.step(x)
        else:
            sched.step(target=y)
    except ValueError as exc:
        return str(exc)
    return "no error"


def eval_then_train(ctx, transport: str, schedule: str) -> dict:
    """Two forward-only steps (``schedule.eval``), then one training step, on one pipeline."""
    pp = ctx.world_size
    with rpc_agents(ctx) if transport == "rpc" else contextlib.nullcontext():
        _, module, stage = make_stage(ctx, pp, transport)
        sched = SCHEDULES[schedule](stage, 4, loss_fn=lm_loss)
        x, y = batch(0)
        args = (x,) if stage.is_first else ()
        target = y if stage.is_last else None
        evals = []
        for _ in range(2):
            got: list = []
            sched.eval(*args, target=target, losses=got)
            evals.append(torch.stack(got).mean().item() if got else None)
        grads_after_eval = [p.grad for p in module.parameters()]
        trained: list = []
        sched.step(*args, target=target, losses=trained)
        if transport == "rpc":
            dist.barrier()
        return {"last": stage.is_last, "evals": evals,
                "train": torch.stack(trained).mean().item() if trained else None,
                "no_grad_after_eval": all(g is None for g in grads_after_eval),
                "grads_after_train": all(p.grad is not None for p in module.parameters())}
