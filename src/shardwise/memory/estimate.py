"""Model-state bytes per rank, estimated before anything runs (the ZeRO paper's arithmetic).

[Note: model-state estimates]
Model state is parameters, gradients and optimizer state. With P parameter elements, world size N
and K bytes of optimizer state per element (AdamW: 8, SGD with momentum: 4), each rank holds:

    strategy  parameters      gradients       optimizer state
    ddp       P * p           P * g           P * K
    zero1     P * p           P * g           P * K / N
    zero2     P * p           P * g / N       P * K / N
    fsdp      P * p / N       P * g / N       P * K / N

where p and g are the bytes of one parameter and gradient element. Sharded parts are rounded up
per rank: FSDP pads each unit to a multiple of N, ZeRO splits whole parameters so one rank may
hold up to one parameter more than P / N. Optimizers that keep a per-tensor step counter add one
small tensor per parameter they own. Everything transient (activations, FSDP's gathered units,
communication buckets) comes on top; ``shardwise.memory.state_bytes`` measures what a live rank
holds, and tests check the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from shardwise.memory.accounting import StateBytes

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")

# optimizer name -> (bytes of state per parameter element in fp32, bytes of per-tensor state)
OPTIMIZER_STATE = {
    "adamw": (8, 4),  # exp_avg, exp_avg_sq; a float32 `step` tensor per parameter
    "adam": (8, 4),
    "sgd-momentum": (4, 0),  # momentum_buffer
    "sgd": (0, 0),
    "adagrad": (4, 4),  # sum; step
}


def parameter_sizes(module: nn.Module) -> list[int]:
    """Element counts of ``module``'s distinct trainable parameters (tied weights once).

    Works on a model built on the meta device, so a model too big for this machine can be
    planned: ``with torch.device("meta"): model = build()``.
    """
    seen: set[int] = set()
    sizes = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            sizes.append(p.numel())
    return sizes


def estimate_state_bytes(sizes: Sequence[int], strategy: str, world_size: int, *,
                         optimizer: str = "adamw", param_dtype: torch.dtype = torch.float32,
                         units: Iterable[Sequence[int]] | None = None) -> StateBytes:
    """Bytes of model state one rank holds between steps; see [Note: model-state estimates].

    ``sizes`` are the element counts of the trainable parameters. ``units`` (FSDP only) groups
    them as the wrapping does (each unit is padded on its own); default: one unit.
    """
    _check(strategy, world_size, optimizer)
    per_elem, per_tensor = OPTIMIZER_STATE[optimizer]
    elem = torch.empty((), dtype=param_dtype).element_size()
    total, n = sum(sizes), world_size
    if strategy == "ddp":
        return StateBytes(total * elem, total * elem, total * per_elem + len(sizes) * per_tensor)
    if strategy in ("zero1", "zero2"):
        shard = math.ceil(total / n)
        tensors = math.ceil(len(sizes) / n)
        optim = shard * per_elem + tensors * per_tensor
        grads = total * elem if strategy == "zero1" else shard * elem
        return StateBytes(total * elem, grads, optim)
    groups = [list(u) for u in units] if units is not None else [list(sizes)]
    shard = sum(math.ceil(sum(u) / n) for u in groups)  # each unit padded to a multiple of N
    return StateBytes(shard * elem, shard * elem, shard * per_elem + len(groups) * per_tensor)


def _check(strategy: str, world_size: int, optimizer: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; estimates exist for {list(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE)}")
