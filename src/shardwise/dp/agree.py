"""Checking that every rank built the same model before a mechanism relies on it.

DDP, ZeRO and FSDP assume that parameter ``i`` on one rank is parameter ``i`` on every rank:
ranks that built different models (another config, a branch on the rank) would otherwise train
silently wrong, or abort deep inside a collective. ``check_same_model`` compares a compact
signature (each parameter's and buffer's name, shape, dtype and requires_grad, in order).

Collectives: one all-gather of an 8-byte hash per rank. Only when the hashes differ (every rank
sees that at once, so all take the same path) two more all-gathers carry each rank's signature
as JSON bytes, so that the error can name the first difference and the ranks that differ. Peers'
bytes are parsed as JSON, never unpickled.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.collectives import all_gather_bytes
from shardwise.distributed.groups import collective_device, global_ranks


class ModelMismatchError(RuntimeError):
    """The ranks of a group hold models of different structure; the message says where."""


def model_signature(module: nn.Module) -> list[list]:
    """``[kind, name, shape, dtype, requires_grad]`` per parameter, then per buffer, in order."""
    rows = [["parameter", name, list(p.shape), str(p.dtype).removeprefix("torch."),
             bool(p.requires_grad)] for name, p in module.named_parameters()]
    rows += [["buffer", name, list(b.shape), str(b.dtype).removeprefix("torch."), False]
             for name, b in module.named_buffers()]
    return rows


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None = None,
                     what: str = "model") -> None:
    """Raise ``ModelMismatchError`` on every rank of ``group`` unless all hold the same
    structure; ``what`` names the caller in the message (e.g. "DistributedDataParallel")."""
    _check_signature(model_signature(module), group, what)


def check_same_parameters(params: list[torch.Tensor], group: dist.ProcessGroup | None = None,
                          what: str = "optimizer") -> None:
    """``check_same_model`` for a list of parameters (an optimizer's), named by position."""
    signature = [["parameter", f"params[{i}]", list(p.shape),
                  str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
                 for i, p in enumerate(params)]
    _check_signature(signature, group, what)


def _check_signature(signature: list[list], group: dist.ProcessGroup | None, what: str) -> None:
    encoded = json.dumps(signature, separators=(",", ":")).encode()
    digest = int.from_bytes(hashlib.sha256(encoded).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=collective_device(group))
    world = dist.get_world_size(group)
    digests = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(digests, mine, group=group)
    values = [int(d.item()) for d in digests]
    if len(set(values)) == 1:
        return
    signatures = [json.loads(b) for b in all_gather_bytes(encoded, group)]
    ranks = global_ranks(group)
    differ = [ranks[i] for i in range(world) if values[i] != values[0]]
    first = next(i for i in range(world) if values[i] != values[0])
    raise ModelMismatchError(
        f"{what}: the ranks hold different models; rank(s) {differ} differ from rank "
        f"{ranks[0]}: {first_difference(signatures[0], signatures[first], ranks[0], ranks[first])}"
    )


def first_difference(a: list[list], b: list[list], rank_a: int, rank_b: int) -> str:
    """The first row where two signatures differ, in words."""
    for index, (row_a, row_b) in enumerate(zip(a, b)):
        if row_a != row_b:
            return (f"entry {index} is {_describe(row_a)} on rank {rank_a} but "
                    f"{_describe(row_b)} on rank {rank_b}")
    longer, rank = (a, rank_a) if len(a) > len(b) else (b, rank_b)
    extra = longer[min(len(a), len(b))]
    return (f"rank {rank_a} has {len(a)} entries, rank {rank_b} has {len(b)}; the first extra "
            f"one, on rank {rank}, is {_describe(extra)}")


def _describe(row: list) -> str:
    kind, name, shape, dtype, grad = row
    extra = "" if kind == "buffer" else f", requires_grad={grad}"
    return f"{kind} {name!r} {tuple(shape)} {dtype}{extra}"
