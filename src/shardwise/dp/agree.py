"""Checking that every rank built the same model before a mechanism relies on it.

DDP, ZeRO and FSDP assume that parameter ``i`` on one rank is parameter ``i`` on every rank:
ranks that built different models (another config, a branch on the rank) would otherwise train
silently wrong, or abort deep inside a collective. ``check_same_model`` compares a compact
signature (each parameter's and buffer's name, shape, dtype and requires_grad, in order).

Collectives: two all-reduces of one 8-byte number, launched together: the largest hash of any
rank and the largest negated hash (the smallest hash), so the cost does not grow with the
group's size. When the two differ, every rank sees that at once, so all take the same path:
one all-gather of each rank's hash names the ranks that differ, and two more carry each rank's
signature as JSON bytes, so that the error can name the first difference. Peers' bytes are
parsed as JSON, never unpickled.

Each number travels in a tensor of its own: in a dry run (shardwise.sim) a one-element tensor
keeps its value through a collective of the fake process group, which moves no data, so every
rank agrees with itself there.
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
    if dist.get_world_size(group) == 1:
        return  # one rank agrees with itself: no collective
    encoded = json.dumps(signature, separators=(",", ":")).encode()
    # 62 bits, so that the negated hash fits an int64 too
    digest = int.from_bytes(hashlib.sha256(encoded).digest()[:8], "little") >> 2
    if _extremes_agree(digest, group):
        return
    device = collective_device(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    digests = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(digests, mine, group=group)
    values = [int(d.item()) for d in digests]
    signatures = [json.loads(b) for b in all_gather_bytes(encoded, group)]
    ranks = global_ranks(group)
    differ = [ranks[i] for i, v in enumerate(values) if v != values[0]]
    first = next(i for i, v in enumerate(values) if v != values[0])
    raise ModelMismatchError(
        f"{what}: the ranks hold different models; rank(s) {differ} differ from rank "
        f"{ranks[0]}: {first_difference(signatures[0], signatures[first], ranks[0], ranks[first])}"
    )


def _extremes_agree(value: int, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` passed the same ``value``: the largest and the smallest
    of them are equal. Collective: two all-reduces (max) of one int64, issued together."""
    device = collective_device(group)
    high = torch.tensor([value], dtype=torch.int64, device=device)
    neg_low = torch.tensor([-value], dtype=torch.int64, device=device)
    works = [dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
             for t in (high, neg_low)]
    for work in works:
        work.wait()
    return int(high.item()) == -int(neg_low.item())


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
