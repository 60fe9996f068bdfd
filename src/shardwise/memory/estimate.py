"""Model-state bytes per rank, estimated before anything runs (the ZeRO paper's arithmetic).

[Note: model-state estimates]
Model state is parameters, gradients and optimizer state. With P parameter elements, world size N
and K bytes of optimizer state per element (AdamW: 8, SGD with momentum: 4), each rank holds:

    strategy  parameters      gradients       optimizer state
    ddp       P * p           P * g           P * K
    zero1     P * p           P * g           P * K / N
    zero2     P * p           P * g / N       P * K / N
    fsdp      P * p / N       P * g / N       P * K / N

where p and g are the bytes of one parameter and gradient element. ``precision`` sets them:

    precision  p  g  K (AdamW)                          K in general
    fp32       4  4  8  (exp_avg, exp_avg_sq in fp32)    the optimizer's fp32 state
    bf16       2  2  4  (both moments in bf16)           half of it
    mixed      2  2  12 (fp32 master copy + moments)     4 + the fp32 state

``mixed`` is the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1): 16-bit
parameters and gradients, an fp32 master copy and fp32 Adam moments, so (2 + 2 + K) bytes per
parameter with K = 12; its Table 1 is checked cell by cell in tests/memory.

Sharded parts are rounded up per rank: FSDP pads each unit to a multiple of N, ZeRO splits
whole parameters so one rank may hold up to one parameter more than P / N. Optimizers that
keep a per-tensor step counter add one small tensor per parameter they own. Everything
transient (activations, FSDP's gathered units, communication buckets) comes on top;
``shardwise.memory.state_bytes`` measures what a live rank holds, and tests check the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from shardwise.memory.accounting import StateBytes
from shardwise.memory.tables import OPTIMIZER_STATE, PRECISIONS, STRATEGIES


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


def element_bytes(precision: str, optimizer: str = "adamw") -> tuple[int, int, int, int]:
    """(parameter, gradient, optimizer state per element, optimizer state per tensor) bytes
    under ``precision``; see [Note: model-state estimates]. A pure function."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {list(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE)}")
    per_elem, per_tensor = OPTIMIZER_STATE[optimizer]
    if precision == "fp32":
        return 4, 4, per_elem, per_tensor
    if precision == "bf16":
        return 2, 2, per_elem // 2, per_tensor  # torch keeps the moments in the param dtype
    return 2, 2, 4 + per_elem, per_tensor  # the fp32 master copy, then fp32 moments


def estimate_state_bytes(sizes: Sequence[int], strategy: str, world_size: int, *,
                         optimizer: str = "adamw", param_dtype: torch.dtype = torch.float32,
                         units: Iterable[Sequence[int]] | None = None,
                         precision: str | None = None) -> StateBytes:
    """Bytes of model state one rank holds between steps; see [Note: model-state estimates].

    A pure function of its arguments (no tensor is made), shared by `shardwise plan` and the
    tests that compare it with the live byte accounting (``state_bytes``). ``sizes`` are the
    element counts of the trainable parameters. ``units`` (FSDP only) groups them as the
    wrapping does (each unit is padded on its own); default: one unit. ``precision`` (fp32,
    bf16, mixed) overrides ``param_dtype``, which sizes parameters and gradients only.
    """
    _check(strategy, world_size, optimizer)
    elem, grad_elem, per_elem, per_tensor = state_element_bytes(optimizer, param_dtype,
                                                                precision)
    total, n = sum(sizes), world_size
    if strategy == "ddp":
        return StateBytes(total * elem, total * grad_elem,
                          total * per_elem + len(sizes) * per_tensor)
    if strategy in ("zero1", "zero2"):
        shard = math.ceil(total / n)
        tensors = math.ceil(len(sizes) / n)
        optim = shard * per_elem + tensors * per_tensor
        grads = total * grad_elem if strategy == "zero1" else shard * grad_elem
        return StateBytes(total * elem, grads, optim)
    groups = [list(u) for u in units] if units is not None else [list(sizes)]
    return sharded_unit_bytes([sum(u) for u in groups], n,
                              (elem, grad_elem, per_elem, per_tensor))


def state_element_bytes(optimizer: str, param_dtype: torch.dtype,
                        precision: str | None) -> tuple[int, int, int, int]:
    """``element_bytes(precision, optimizer)``, or without a precision: parameters and
    gradients of ``param_dtype``, the optimizer's fp32 state."""
    if precision is not None:
        return element_bytes(precision, optimizer)
    per_elem, per_tensor = OPTIMIZER_STATE[optimizer]
    elem = torch.empty((), dtype=param_dtype).element_size()
    return elem, elem, per_elem, per_tensor


def sharded_unit_bytes(unit_numels: Sequence[int], shard: int,
                       element: tuple[int, int, int, int]) -> StateBytes:
    """FSDP's model state on one rank: each unit of ``unit_numels`` elements flattened and
    padded to a multiple of ``shard`` ranks, one flat parameter (and one per-tensor optimizer
    entry) per unit; ``element`` is ``state_element_bytes``'s answer."""
    elem, grad_elem, per_elem, per_tensor = element
    held = sum(math.ceil(n / shard) for n in unit_numels)
    return StateBytes(held * elem, held * grad_elem,
                      held * per_elem + len(unit_numels) * per_tensor)


def _check(strategy: str, world_size: int, optimizer: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; estimates exist for {list(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE)}")
