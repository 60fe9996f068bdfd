"""`--strategy pipeline`: the GPT split into one stage per rank, driven by RPC from rank 0.

Every rank starts an RPC agent (rendezvous through a fresh TCPStore whose port rank 0 shares
over the gloo group) and keeps its own stage: rank 0 the embeddings and first blocks, the last
rank the final blocks, ``ln_f`` and the head. Rank 0 splits each batch into micro-batches and
sends each through the stages with ``remote()``, every stage fetching its input from the
previous stage directly (``to_here``), so stage k works on micro-batch i while stage k+1 works on
i-1. The loss is computed on rank 0 and backward runs with distributed autograd; each stage's
gradients are then loaded into ``.grad`` and the training loop's own optimizer step (a local
AdamW per stage) applies them. Other ranks' ``train_step`` waits for rank 0's loss (a gloo
broadcast), so every rank logs the same number.
"""

from __future__ import annotations

import atexit
import threading

import torch
import torch.distributed as dist
from torch import nn

import shardwise.rpc as rpc
from shardwise.cli.optim import make_adamw
from shardwise.cli.strategies import Prepared
from shardwise.cli.train_args import TrainConfig
from shardwise.models import GPT, lm_loss
from shardwise.rpc import autograd as dist_autograd
from shardwise.rpc.rendezvous import group_store

MICRO_BATCHES = 2
_stage: dict[str, nn.Module] = {}


class Embed(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class Stage(nn.Module):
    """A run of consecutive layers; one stage's calls run one at a time."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            return self.layers(x)


def split_gpt(gpt: GPT, stages: int) -> list[Stage]:
    """[Embed, blocks..., Head] cut into ``stages`` runs of near-equal length."""
    layers = [Embed(gpt), *gpt.blocks, Head(gpt)]
    if stages > len(layers):
        raise ValueError(f"pipeline of {stages} stages needs at least {stages - 2} blocks, "
                         f"the model has {len(gpt.blocks)}")
    cuts = [round(i * len(layers) / stages) for i in range(stages + 1)]
    return [Stage(layers[a:b]) for a, b in zip(cuts, cuts[1:])]


def stage_forward(stage_rref: rpc.RRef, x_rref: rpc.RRef) -> torch.Tensor:
    return stage_rref.local_value()(x_rref.to_here())


def stage_rref(name: str) -> rpc.RRef:
    return rpc.RRef(_stage[name])


def load_grads(stage_rref_: rpc.RRef, context_id: int) -> None:
    grads = dist_autograd.get_gradients(context_id)
    for p in stage_rref_.local_value().parameters():
        p.grad = grads.get(p)


class PipelineModel(nn.Module):
    """Forward through the stages by RPC; callable on any rank."""

    def __init__(self, stages: list[rpc.RRef], micro_batches: int = MICRO_BATCHES):
        super().__init__()
        self.stages, self.micro_batches = stages, micro_batches

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outs = []
        for chunk in idx.chunk(min(self.micro_batches, idx.shape[0])):
            ref = rpc.RRef(chunk)
            for s in self.stages:
                ref = rpc.remote(s.owner(), stage_forward, args=(s, ref))
            outs.append(ref)
        return torch.cat([r.to_here() for r in outs])

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, distributed backward, and each stage's gradients into its ``.grad``."""
        with dist_autograd.context() as cid:
            loss = lm_loss(self(x), y)
            dist_autograd.backward(cid, [loss])
            for f in [rpc.rpc_async(s.owner(), load_grads, args=(s, cid)) for s in self.stages]:
                f.wait()
        return loss.detach()


def start_rpc(group: dist.ProcessGroup, rank: int, world: int) -> None:
    """An RPC agent per rank, rendezvousing through the process group's own store (the
    launcher's, on any host): no second store, no port picked here."""
    opts = rpc.TensorPipeRpcBackendOptions(store=group_store(group), rpc_timeout=300)
    rpc.init_rpc(f"stage{rank}", rank=rank, world_size=world, rpc_backend_options=opts,
                 allowed_modules=[__name__])
    atexit.register(rpc.shutdown)


def build(model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup,
          device: torch.device) -> Prepared:
    if device.type != "cpu":
        raise ValueError("--strategy pipeline runs on CPU (CUDA device maps are not wired "
                         "into the CLI)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    stage = split_gpt(model, world)[rank]
    _stage[f"stage{rank}"] = stage
    start_rpc(group, rank, world)
    stages = [rpc.rpc_sync(f"stage{r}", stage_rref, args=(f"stage{r}",)) for r in range(world)]
    pipe = PipelineModel(stages)
    optimizer = make_adamw(stage.parameters(), cfg)
    loss_src = dist.get_global_rank(group, 0)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = pipe.train_step(x, y) if rank == 0 else torch.zeros(())
        loss = loss.reshape(1).float().clone()
        dist.broadcast(loss, src=loss_src, group=group)
        return loss

    def state_dict() -> dict:
        return {"stage": stage.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        stage.load_state_dict(state["stage"])
        optimizer.load_state_dict(state["optimizer"])

    return Prepared(pipe, optimizer, state_dict, load_state_dict, per_rank_state=True,
                    data_slice=(0, 1), train_step=train_step)
