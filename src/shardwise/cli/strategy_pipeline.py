"""`--strategy pipeline`: the GPT cut into stages with shardwise.pipeline; this file only wires.

``--nproc N --dp D`` makes D replicas of a pipeline of N / D stages (``pipeline_layout``: rank r
is stage r % (N / D) of replica r // (N / D)); with D > 1 each stage is wrapped in our
DistributedDataParallel over its data-parallel group, which reduces once per step. Each step
runs ``--schedule`` (gpipe or 1f1b) over ``--microbatches`` micro-batches of the replica's
slice of the batch, over ``--transport`` (c10d point-to-point, or RPC with distributed
autograd). Every rank steps a local AdamW on its own stage. The last stage's loss is broadcast
over the pipeline group so that every rank returns its replica's loss to the training loop.
Evaluation runs the schedule's forwards only and broadcasts the last stage's logits likewise.
"""

from __future__ import annotations

import atexit
import math

import torch
import torch.distributed as dist
from torch import nn

import shardwise.rpc as rpc
from shardwise.cli.optim import make_adamw
from shardwise.cli.strategies import Prepared
from shardwise.cli.train_args import TrainConfig
from shardwise.ddp import DistributedDataParallel
from shardwise.models import GPT, lm_loss
from shardwise.pipeline import (
    PipelineLayout,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    pipeline_layout,
    split_gpt,
)
from shardwise.rpc.rendezvous import group_store

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def start_rpc(group: dist.ProcessGroup, rank: int, world: int) -> None:
    """An RPC agent per rank, rendezvousing through the process group's own store (the
    launcher's, on any host): no second store, no port picked here."""
    opts = rpc.TensorPipeRpcBackendOptions(store=group_store(group), rpc_timeout=300)
    rpc.init_rpc(f"stage{rank}", rank=rank, world_size=world, rpc_backend_options=opts,
                 allowed_modules=[__name__])
    atexit.register(rpc.shutdown)


class PipelineForward(nn.Module):
    """``forward(idx)`` on every rank of a pipeline: the stages' forwards only (no graph), the
    last stage's logits broadcast over the pipeline group. Used for evaluation."""

    def __init__(self, stage: PipelineStage, layout: PipelineLayout, microbatches: int,
                 vocab_size: int):
        super().__init__()
        self.stage_module = stage.submod  # a child, so that .train()/.eval() reach it
        self._stage, self._layout = stage, layout
        self._m, self._vocab = microbatches, vocab_size
        self._last = dist.get_global_rank(layout.pp_group, layout.pp - 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        schedule = ScheduleGPipe(self._stage, math.gcd(self._m, idx.shape[0]))
        out = schedule.eval(idx) if self._stage.is_first else schedule.eval()
        if out is None:
            out = torch.empty(*idx.shape, self._vocab, device=idx.device)
        out = out.contiguous()
        dist.broadcast(out, src=self._last, group=self._layout.pp_group)
        return out


def build(model: GPT, cfg: TrainConfig, group: dist.ProcessGroup,
          device: torch.device) -> Prepared:
    world = dist.get_world_size(group)
    if world != dist.get_world_size():
        raise ValueError("--strategy pipeline lays its stages out over the whole world")
    # (--transport rpc with --device cuda is refused by validate() before any rank starts)
    if cfg.transport == "rpc":
        start_rpc(group, dist.get_rank(group), world)
    layout = pipeline_layout(world // cfg.dp)
    inner = split_gpt(model, layout.pp)[layout.stage_index].to(device)
    module: nn.Module = inner
    if layout.dp > 1:
        module = DistributedDataParallel(inner, process_group=layout.dp_group)
    stage = PipelineStage(module, layout.stage_index, layout.pp, device=device,
                          group=layout.pp_group, transport=cfg.transport)
    schedule = SCHEDULES[cfg.schedule](stage, cfg.microbatches, loss_fn=lm_loss)
    optimizer = make_adamw(inner.parameters(), cfg)
    last = dist.get_global_rank(layout.pp_group, layout.pp - 1)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        schedule.step(*(x,) if stage.is_first else (), target=y if stage.is_last else None,
                      losses=losses, return_outputs=False)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        loss = loss.detach().float().reshape(1).clone()
        dist.broadcast(loss, src=last, group=layout.pp_group)
        return loss

    forward = PipelineForward(stage, layout, cfg.microbatches, model.cfg.vocab_size)
    own = {id(p) for p in inner.parameters()}
    owned = {name for name, p in model.named_parameters() if id(p) in own}
    return Prepared(forward, optimizer, data_slice=(layout.replica, layout.dp),
                    train_step=train_step, state_model=model, owned_state=owned.__contains__)
