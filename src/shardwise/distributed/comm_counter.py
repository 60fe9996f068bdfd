"""``CommCounter``: count the collectives a block of code issues, per kind and process group.

Every collective that torch.distributed runs (``dist.broadcast``, ``dist.all_reduce``,
``batch_isend_irecv``, ``all_gather_into_tensor``, ...) and every functional collective
(DTensor's) reaches the dispatcher as an operator of the ``c10d`` or ``_c10d_functional``
namespace, with its tensors and its process group as arguments. ``CommCounter`` is a
``TorchDispatchMode``, as torch's ``CommDebugMode`` is: while the ``with`` block runs it sees
those operators, collectives issued from autograd hooks during backward included, and counts
each by its logical pattern (see [Note: counting communication] in comm_patterns.py). Nothing is
patched: outside the block no mode is installed and nothing is paid. Inside it, every operator
of the thread goes through one Python call, so it is a measuring tool, not for timed runs.
Collectives issued on other threads are not seen (dispatch modes are per thread).

    with CommCounter(local_world_size=2) as comm:
        model(x).sum().backward()
    comm.get("all_reduce", group).sent_bytes
    print(comm.table())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise._compat import FakeTensor, TorchDispatchMode, resolve_process_group
from shardwise.distributed.comm_patterns import KINDS, CommStats, traffic
from shardwise.distributed.topology import local_world_size_from_env, node_of

__all__ = ["CommCounter", "CommStats", "lowers_itself"]


def lowers_itself(cls: type) -> bool:
    """A dispatch type that is a tensor subclass with its own dispatch (DTensor), which the
    counter lets lower itself (its collectives come back as operators on plain tensors).

    A ``FakeTensor`` is not one: it carries no data and issues nothing, and its operators must
    run inside the counter. torch's DTensor propagates shardings by running operators on fake
    tensors with ``FakeTensorMode`` active; a mode that answered ``NotImplemented`` there would
    leave the operator with no handler (FakeTensor itself declines when its mode is active).
    """
    if cls is torch.Tensor:
        return False
    return not (isinstance(FakeTensor, type) and issubclass(cls, FakeTensor))


class CommCounter(TorchDispatchMode):
    """Per (collective kind, process group name): calls, bytes handed in, bytes sent, and bytes
    sent to ranks on other nodes, as this rank saw them. Off (and free) outside ``with``.

    ``local_world_size``: ranks per node, node of a rank = global rank // it (default:
    ``LOCAL_WORLD_SIZE`` as torchrun sets it, else the whole world is one node).
    """

    def __init__(self, *, local_world_size: int | None = None):
        super().__init__()
        if local_world_size is not None and local_world_size < 1:
            raise ValueError(f"local_world_size must be positive, got {local_world_size}")
        self._local_world_size = local_world_size
        self.counts: dict[tuple[str, str], CommStats] = {}  # (kind, group name) -> totals
        self.group_ranks: dict[str, tuple[int, ...]] = {}  # group name -> its global ranks

    def __enter__(self) -> CommCounter:
        if self._local_world_size is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            self._local_world_size = local_world_size_from_env(world)
        super().__enter__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(lowers_itself(t) for t in types):
            return NotImplemented  # DTensor lowers itself; its collectives come back here
        out = func(*args, **kwargs)
        reader = _READERS.get(getattr(func, "_schema", None) and func._schema.name)
        if reader is not None:
            kind, group, sizes = reader(*args, **kwargs)
            self._record(kind, group, sizes)
        return out

    def _record(self, kind: str, group: dist.ProcessGroup, sizes: list[dict]) -> None:
        ranks = self._ranks(group)
        me = group.rank()
        lws = self._local_world_size or 1
        total = CommStats()
        for s in sizes:  # one entry per tensor of a coalesced call
            total = total + traffic(kind, ranks, me, node_of=lambda r: node_of(r, lws), **s)
        if len(sizes) != 1:  # a coalesced call (or a barrier) is one call
            total = CommStats(1, total.bytes, total.sent_bytes, total.cross_node_bytes)
        key = (kind, group.group_name)
        self.counts[key] = self.counts.get(key, CommStats()) + total

    def _ranks(self, group: dist.ProcessGroup) -> tuple[int, ...]:
        name = group.group_name
        if name not in self.group_ranks:
            self.group_ranks[name] = tuple(dist.get_process_group_ranks(group))
        return self.group_ranks[name]

    def get(self, kind: str | None = None,
            group: dist.ProcessGroup | str | None = None) -> CommStats:
        """Totals over the entries of ``kind`` (all kinds: None) on ``group`` (a group or its
        name; all groups: None)."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; known: {list(KINDS)}")
        name = group.group_name if isinstance(group, dist.ProcessGroup) else group
        total = CommStats()
        for (k, g), stats in self.counts.items():
            if (kind is None or k == kind) and (name is None or g == name):
                total = total + stats
        return total

    def per_kind(self, field: str = "calls") -> dict[str, int]:
        """``field`` of ``CommStats`` (calls, bytes, sent_bytes, cross_node_bytes) summed over
        the groups, per collective kind that was seen."""
        out: dict[str, int] = {}
        for (kind, _), stats in sorted(self.counts.items()):
            out[kind] = out.get(kind, 0) + getattr(stats, field)
        return out

    def table(self) -> str:
        """One line per (kind, group): calls, bytes handed in, sent, sent to other nodes."""
        lines = [f"{'kind':<16}{'group ranks':<24}{'calls':>8}{'bytes':>14}{'sent':>14}"
                 f"{'cross-node':>14}"]
        for (kind, name), s in sorted(self.counts.items()):
            ranks = _short(self.group_ranks.get(name, ()))
            lines.append(f"{kind:<16}{ranks:<24}{s.calls:>8}{s.bytes:>14}{s.sent_bytes:>14}"
                         f"{s.cross_node_bytes:>14}")
        return "\n".join(lines)


def _short(ranks: tuple[int, ...]) -> str:
    text = str(list(ranks))
    return text if len(text) <= 22 else text[:19] + "..."


# --- reading each operator's arguments --------------------------------------------------------
# A reader returns (kind, process group, [sizes for comm_patterns.sends, one per tensor]).

def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buffer(t: torch.Tensor) -> dict:
    return {"nbytes": _nb(t), "element_size": t.element_size()}


def _pg(obj: Any) -> dist.ProcessGroup:
    if isinstance(obj, dist.ProcessGroup):
        return obj
    if isinstance(obj, torch.ScriptObject):
        return dist.ProcessGroup.unbox(obj)
    return resolve_process_group(obj)  # a functional collective names its group


def _split_rows(t: torch.Tensor, splits: list[int]) -> dict:
    """Parts of an all_to_all_single input: ``splits`` rows each, or n equal parts."""
    if not splits:
        return _buffer(t)
    row = _nb(t) // max(t.size(0), 1) if t.dim() else _nb(t)
    return {"parts": [int(s) * row for s in splits]}


def _c10d_readers() -> dict[str, Callable[..., tuple[str, dist.ProcessGroup, list[dict]]]]:
    def per_tensor(kind):
        return lambda tensors, pg, *a, **k: (kind, _pg(pg), [_buffer(t) for t in tensors])

    return {
        "c10d::broadcast_": lambda ts, pg, root, *a, **k: (
            "broadcast", _pg(pg), [_buffer(t) | {"peer": root} for t in ts]),
        "c10d::allreduce_": per_tensor("all_reduce"),
        "c10d::allreduce_coalesced_": per_tensor("all_reduce"),
        "c10d::_allgather_base_": lambda out, inp, pg, *a, **k: (
            "all_gather", _pg(pg), [_buffer(inp)]),
        "c10d::allgather_": lambda outs, ins, pg, *a, **k: (
            "all_gather", _pg(pg), [_buffer(t) for t in ins]),
        "c10d::allgather_coalesced_": lambda outs, ins, pg, *a, **k: (
            "all_gather", _pg(pg), [_buffer(t) for t in ins]),
        "c10d::allgather_into_tensor_coalesced_": lambda outs, ins, pg, *a, **k: (
            "all_gather", _pg(pg), [_buffer(t) for t in ins]),
        "c10d::_reduce_scatter_base_": lambda out, inp, pg, *a, **k: (
            "reduce_scatter", _pg(pg), [_buffer(inp)]),
        "c10d::reduce_scatter_tensor_coalesced_": lambda outs, ins, pg, *a, **k: (
            "reduce_scatter", _pg(pg), [_buffer(t) for t in ins]),
        "c10d::reduce_scatter_": lambda outs, ins, pg, *a, **k: (
            "reduce_scatter", _pg(pg), [{"parts": [_nb(t) for t in per_rank]}
                                        for per_rank in ins]),
        "c10d::alltoall_base_": lambda out, inp, pg, out_splits, in_splits, *a, **k: (
            "all_to_all", _pg(pg), [_split_rows(inp, list(in_splits))]),
        "c10d::alltoall_": lambda outs, ins, pg, *a, **k: (
            "all_to_all", _pg(pg), [{"parts": [_nb(t) for t in ins]}]),
        "c10d::reduce_": lambda ts, pg, op, root, *a, **k: (
            "reduce", _pg(pg), [_buffer(t) | {"peer": root} for t in ts]),
        "c10d::gather_": lambda outs, ins, pg, root, *a, **k: (
            "gather", _pg(pg), [_buffer(t) | {"peer": root} for t in ins]),
        "c10d::scatter_": lambda outs, ins, pg, root, *a, **k: _scatter(outs, ins, pg, root),
        "c10d::send": lambda ts, pg, dst, *a, **k: (
            "send", _pg(pg), [_buffer(t) | {"peer": dst} for t in ts]),
        "c10d::recv_": lambda ts, pg, src, *a, **k: (
            "recv", _pg(pg), [{"peer": src} for _ in ts]),
        "c10d::recv_any_source_": lambda ts, pg, *a, **k: ("recv", _pg(pg), [{"peer": 0}]),
        "c10d::barrier": lambda t, pg, *a, **k: ("barrier", _pg(pg), []),
    }


def _scatter(outs, ins, pg, root):
    group = _pg(pg)
    if group.rank() != root or not ins:
        return "scatter", group, [{"peer": root} for _ in outs]
    return "scatter", group, [{"parts": [_nb(t) for t in ins[0]], "peer": root}]


def _functional_readers() -> dict[str, Callable[..., tuple[str, dist.ProcessGroup, list[dict]]]]:
    # group ranks (src) and group names as the functional collectives take them
    def one(kind, group_at):
        return lambda *a, **k: (kind, _pg(a[group_at]), [_buffer(a[0])])

    def many(kind, group_at):
        return lambda *a, **k: (kind, _pg(a[group_at]), [_buffer(t) for t in a[0]])

    return {
        "_c10d_functional::all_gather_into_tensor": one("all_gather", 2),
        "_c10d_functional::all_gather_into_tensor_out": one("all_gather", 2),
        "_c10d_functional::all_gather_into_tensor_coalesced": many("all_gather", 2),
        "_c10d_functional::all_reduce": one("all_reduce", 2),
        "_c10d_functional::all_reduce_": one("all_reduce", 2),
        "_c10d_functional::all_reduce_coalesced": many("all_reduce", 2),
        "_c10d_functional::reduce_scatter_tensor": one("reduce_scatter", 3),
        "_c10d_functional::reduce_scatter_tensor_out": one("reduce_scatter", 3),
        "_c10d_functional::reduce_scatter_tensor_coalesced": many("reduce_scatter", 3),
        "_c10d_functional::all_to_all_single": lambda inp, out_s, in_s, name, *a, **k: (
            "all_to_all", _pg(name), [_split_rows(inp, list(in_s))]),
        "_c10d_functional::broadcast": lambda inp, src, name, *a, **k: (
            "broadcast", _pg(name), [_buffer(inp) | {"peer": src}]),
        "_c10d_functional::broadcast_": lambda inp, src, name, *a, **k: (
            "broadcast", _pg(name), [_buffer(inp) | {"peer": src}]),
    }


_READERS = {**_c10d_readers(), **_functional_readers()}
