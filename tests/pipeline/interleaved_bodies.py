"""Bodies of the interleaved 1F1B tests (run on every rank of the pool): a float64 demo GPT,
its stages k on rank k % world, trained a few steps; GPipe (one stage per rank) on the same
batches beside it."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.models import GPT, GPTConfig
from shardwise.pipeline import (
    PipelineStage,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    split_gpt,
)
from tests.harness import reference_train, token_batch
from tests.pipeline.bodies import rpc_agents

CFG = GPTConfig(vocab_size=32, n_layer=6, n_head=2, d_model=16, seq_len=8)
BATCH, STEPS, LR = 8, 3, 1e-2


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The demo's next-token loss kept in float64 (the library's casts to float32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step, 1, BATCH, CFG.seq_len, CFG.vocab_size)
    return x[0], y[0]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).double()


def reference() -> tuple[list[float], dict[str, torch.Tensor], float]:
    """One process, the whole batch: each step's loss, the first step's gradients, and the
    trained model's loss on batch 0."""
    def loss(model, step):
        x, y = batch(step)
        return lm_loss(model(x), y)

    run = reference_train(_gpt, loss, lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                          STEPS, seed=None, keep_grads=True)
    x, y = batch(0)
    with torch.no_grad():
        after = lm_loss(run.model(x), y).item()
    return run.losses, run.grads[0], after


def _train(stages: list[PipelineStage], schedule, gpt: GPT) -> dict:
    """STEPS AdamW steps of ``schedule``; this rank's losses and first step's gradients (by the
    GPT's parameter names)."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, grads = [], {}
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    for step in range(STEPS):
        x, y = batch(step)
        got: list = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=got)
        if step == 0:
            grads = {names[id(p)]: p.grad.clone() for p in params}
        opt.step()
        opt.zero_grad()
        if got:
            losses.append(torch.stack(got).mean().item())
    return {"losses": losses, "grads": grads}


def interleaved_and_gpipe(ctx, transport: str, local_stages: int = 2, micro: int = 4) -> dict:
    """The same training under GPipe (one stage per rank) and under interleaved 1F1B
    (``local_stages`` per rank), each from the same initial model."""
    world, rank = ctx.world_size, ctx.rank
    with rpc_agents(ctx) if transport == "rpc" else contextlib.nullcontext():
        gpt = _gpt()
        stage = PipelineStage(split_gpt(gpt, world)[rank], rank, world, transport=transport,
                              name="gpipe")
        gpipe = _train([stage], ScheduleGPipe(stage, micro, loss_fn=lm_loss), gpt)
        gpt = _gpt()
        n = world * local_stages
        parts = split_gpt(gpt, n)
        stages = [PipelineStage(parts[k], k, n, transport=transport, name="interleaved")
                  for k in range(rank, n, world)]
        sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=lm_loss)
        inter = _train(stages, sched, gpt)
        inter["idle"] = sched.idle_fraction
        x, y = batch(0)
        evals: list = []
        sched.eval(*((x,) if 0 in range(rank, n, world) else ()),
                   target=y if rank == world - 1 else None, losses=evals)
        inter["eval"] = torch.stack(evals).mean().item() if evals else None
        inter["grads_kept"] = all(p.grad is None for s in stages for p in s.submod.parameters())
        if transport == "rpc":
            dist.barrier()  # every stage done with its RPCs before the agents stop
        return {"gpipe": gpipe, "interleaved": inter}


def bad_interleaved(ctx) -> list[str]:
    """Errors for stages that do not make an interleaved schedule on this rank."""
    world, rank = ctx.world_size, ctx.rank
    parts = split_gpt(_gpt(), 2 * world)
    mine = [PipelineStage(parts[k], k, 2 * world) for k in range(rank, 2 * world, world)]
    messages = []
    for make in (lambda: ScheduleInterleaved1F1B(mine[:1], 4, loss_fn=lm_loss),
                 lambda: ScheduleInterleaved1F1B(mine, 4),
                 lambda: ScheduleInterleaved1F1B(mine, 5, loss_fn=lm_loss),
                 lambda: ScheduleGPipe(mine[0], 4, loss_fn=lm_loss),
                 lambda: PipelineStage(parts[rank + 1], rank + 1, 2 * world)):
        try:
            make()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages
