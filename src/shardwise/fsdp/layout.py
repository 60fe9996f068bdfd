"""Where each parameter's rows live, sharded and unsharded (pure functions), and the parameters
as torch DTensors over those rows.

[Note: FSDP layout]
Every parameter is sharded on dim 0 the way ``torch.chunk`` and DTensor's ``Shard(0)`` split it:
with ``rows`` rows over ``world`` ranks, each rank's chunk has ``chunk_rows = ceil(rows /
world)`` rows and rank r owns rows ``[r * chunk_rows, min((r + 1) * chunk_rows, rows))``; the
last ranks may own fewer rows, or none. So a parameter's local shard is exactly the local tensor
of a ``DTensor`` with placement ``Shard(0)``, as in torch's FSDP2.

A unit keeps one flat shard per rank (1D, ``shard_numel`` elements, the same on every rank):
each parameter's chunk at the same ``shard_offset`` on every rank, padded to ``chunk_rows``
rows (padding rows are zero and never read). The unsharded parameters live back to back in one
flat buffer of ``total`` elements (``full_offset``), without padding, so each module attribute
is a plain view of it.

Gathering moves chunk r of every parameter from rank r into the rows rank r owns. The chunks of
a large parameter are broadcast straight into those rows (one collective per rank and
parameter, no copy); small parameters would cost one collective each for a few bytes, so they
are ``packed``: laid out at the end of the shard, gathered together (one all-gather of the
packed region) into a rank-major buffer and copied out into their rows. Which parameters are
packed is decided once by ``plan_layout`` from ``direct_min_numel``: on NCCL every parameter is
packed (one all-gather per unit, the fastest collective there), on gloo parameters whose chunk
has at least ``direct_min_numel`` elements go direct (broadcasts are gloo's fastest all-gather,
see [Note: fast collectives]).

Gradients go the other way: each parameter's gradient is copied (or added, when accumulating)
into a rank-major flat buffer of ``world * shard_numel`` elements, chunk r into rank r's block
at the parameter's ``shard_offset``, so one reduce-scatter of the flat buffer leaves each rank
the averaged gradient of its own chunks, laid out like its shard. On gloo the large parameters
skip that buffer and are sent straight from their gradients, see [Note: direct gradient
reduction] (reduction.py).

FSDP's sharded parameters are torch DTensors (``Shard(0)`` on a 1D mesh of the unit's group;
``(Replicate(), Shard(0))`` on a 2D mesh for hybrid sharding). Presenting each local shard as
a ``DTensor`` is what makes torch's own code work on a sharded model without special cases:
``torch.nn.utils.clip_grad_norm_`` reduces the partial norms across ranks, ``full_tensor()``
gathers, DCP's state-dict helpers and ``distribute_tensor`` see global shapes, and
``reset_parameters()`` computes fan-in from the global shape. The local tensor of
each DTensor aliases its rows of the unit's flat shard (see [Note: FSDP layout]), so an
optimizer stepping the DTensors writes straight into the buffer the all-gather reads.

[Note: a local tensor at the start of its storage]
torch (since 2.10) gives a DTensor the storage offset of its local tensor, so a DTensor over a
view that starts inside its storage has a nonzero data pointer although it holds no storage,
and ``copy.deepcopy`` and ``torch.save`` take the path for tensors with storage and fail
("Attempted to call copy_() on an invalid python storage"): ``torch.save(model.state_dict(),
path)``, and torch DCP's ``async_save`` of it (its staging deep-copies), failed for every
parameter after a unit's first. torch's FSDP2 gives each parameter a
storage of its own. Ours keep one flat buffer per unit, and each local tensor (parameter,
gradient, state dict entry) is given a storage of its own that starts at its first element: a
slice of the buffer's storage, the same memory, which keeps the buffer alive. Fake and meta
tensors (a dry run, deferred initialization) are left as they are.
tests/fsdp/test_fsdp_state_dict_copies.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise._compat import DTensor, Replicate, Shard
from shardwise.distributed.groups import collective_device


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's place in a unit's buffers (the same on every rank)."""

    shape: tuple[int, ...]
    chunk_rows: int  # rows per rank: ceil(rows / world)
    shard_offset: int  # start of its chunk in every rank's flat shard
    full_offset: int  # start in the unsharded flat buffer
    packed: bool  # gathered with the unit's other small parameters, then copied out
    world: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk_numel(self) -> int:
        """Elements of one rank's (padded) chunk in the flat shard."""
        return self.chunk_rows * self.row_numel

    def local_rows(self, rank: int) -> int:
        """Rows that ``rank`` owns (``torch.chunk`` semantics: the last ranks may own fewer)."""
        return max(0, min(self.chunk_rows, self.rows - rank * self.chunk_rows))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return (self.local_rows(rank), *self.shape[1:])

    def local_numel(self, rank: int) -> int:
        return self.local_rows(rank) * self.row_numel

    def row_start(self, rank: int) -> int:
        """First row that ``rank`` owns (where its chunk starts in the whole parameter)."""
        return min(rank * self.chunk_rows, self.rows)


@dataclass(frozen=True)
class UnitLayout:
    """Every parameter's layout plus the sizes of the unit's flat buffers."""

    params: list[ParamLayout]  # in the order the parameters were given
    shard_numel: int  # elements of each rank's flat shard (chunks padded)
    packed_offset: int  # where the packed region starts in the shard; it runs to the end
    total: int  # elements of the unsharded flat buffer

    @property
    def packed_numel(self) -> int:
        return self.shard_numel - self.packed_offset

    def direct(self) -> list[tuple[int, ParamLayout]]:
        return [(i, p) for i, p in enumerate(self.params) if not p.packed and p.numel]

    def packed(self) -> list[tuple[int, ParamLayout]]:
        return [(i, p) for i, p in enumerate(self.params) if p.packed and p.numel]


def check_shardable(name: str, shape: Sequence[int]) -> None:
    """FSDP shards dim 0, so a parameter needs one."""
    if len(shape) == 0:
        raise ValueError(f"FSDP shards parameters on dim 0; {name} is a scalar (0-dim): give it "
                         "shape (1,) or keep its module out of fully_shard")


def plan_layout(shapes: Sequence[Sequence[int]], world: int,
                direct_min_numel: float = math.inf) -> UnitLayout:
    """The layout of a unit with parameters of ``shapes`` over ``world`` ranks: parameters whose
    chunk has at least ``direct_min_numel`` elements are gathered directly, the rest packed.
    Direct chunks come first in the shard, packed ones after them, each group in the given
    order; the unsharded buffer keeps the given order."""
    if world < 1:
        raise ValueError(f"world size must be at least 1, got {world}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    chunk_rows = [-(-s[0] // world) for s in shapes]
    row_numels = [math.prod(s[1:]) for s in shapes]
    packed = [c * r < direct_min_numel for c, r in zip(chunk_rows, row_numels)]
    shard_offsets = [0] * len(shapes)
    at = 0
    for want_packed in (False, True):
        for i, is_packed in enumerate(packed):
            if is_packed == want_packed:
                shard_offsets[i] = at
                at += chunk_rows[i] * row_numels[i]
    packed_offset = at - sum(c * r for c, r, p in zip(chunk_rows, row_numels, packed) if p)
    params, full_at = [], 0
    for i, shape in enumerate(shapes):
        params.append(ParamLayout(shape, chunk_rows[i], shard_offsets[i], full_at, packed[i],
                                  world))
        full_at += math.prod(shape)
    return UnitLayout(params, at, packed_offset, full_at)


def chunks_of(flat_param: torch.Tensor, layout: ParamLayout) -> list[tuple[int, torch.Tensor]]:
    """``[(rank, rows of flat_param that rank owns, flattened)]`` for ranks owning any rows;
    ``flat_param`` is the whole parameter, flattened (or its place in a flat buffer)."""
    out = []
    for rank in range(layout.world):
        n = layout.local_numel(rank)
        if n:
            start = layout.row_start(rank) * layout.row_numel
            out.append((rank, flat_param[start : start + n]))
    return out


def copy_into_chunks(dest: torch.Tensor, src: torch.Tensor, layout: ParamLayout,
                     accumulate: bool) -> None:
    """Copy (or add) the whole parameter ``src`` into its chunks of a rank-major flat buffer:
    ``dest`` is the (world, chunk_numel) view of those chunks; padding is zeroed on a copy."""
    flat = src.reshape(-1)
    full, rem = divmod(layout.rows, layout.chunk_rows) if layout.chunk_rows else (0, 0)
    n = layout.chunk_numel
    body = flat[: full * n].view(full, n)
    if accumulate:
        dest[:full].add_(body)
    else:
        dest[:full].copy_(body)
    if rem:
        tail = flat[full * n :]
        if accumulate:
            dest[full, : tail.numel()].add_(tail)
        else:
            dest[full, : tail.numel()].copy_(tail)
            dest[full, tail.numel() :].zero_()
    if not accumulate:
        dest[full + (1 if rem else 0) :].zero_()


def copy_from_chunks(dest: torch.Tensor, src: torch.Tensor, layout: ParamLayout) -> None:
    """Inverse of ``copy_into_chunks``: fill the whole flat parameter ``dest`` from the
    (world, chunk_numel) view ``src`` of its chunks in a rank-major buffer."""
    full, rem = divmod(layout.rows, layout.chunk_rows) if layout.chunk_rows else (0, 0)
    n = layout.chunk_numel
    dest[: full * n].view(full, n).copy_(src[:full])
    if rem:
        tail = dest[full * n :]
        tail.copy_(src[full, : tail.numel()])


# ---- the parameters as DTensors over their rows -------------------------------------------------
def device_type_of(group: dist.ProcessGroup | None = None) -> str:
    """The mesh device type for ``group``'s backend (default: the world's): NCCL's is CUDA."""
    return collective_device(group).type


def mesh_for_group(group: dist.ProcessGroup) -> DeviceMesh:
    """A 1D mesh over ``group`` (no new process group is created)."""
    return DeviceMesh.from_group(group, device_type_of(group))


def placements(mesh: DeviceMesh) -> list:
    """``[Shard(0)]`` on a 1D mesh; ``[Replicate(), Shard(0)]`` on a 2D (hybrid) mesh, whose
    dim 0 replicates and dim 1 shards, as torch's FSDP2 lays out HSDP."""
    return [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]


def at_storage_start(local: torch.Tensor) -> torch.Tensor:
    """``local`` (contiguous) over a storage of its own that starts at its first element: the
    same memory ([Note: a local tensor at the start of its storage])."""
    if (local.storage_offset() == 0 or type(local) is not torch.Tensor
            or local.device.type == "meta" or not local.is_contiguous()):
        return local
    size = local.element_size()
    start = local.storage_offset() * size
    storage = local.untyped_storage()[start : start + local.numel() * size]
    out = torch.empty(0, dtype=local.dtype, device=local.device)
    with torch.no_grad():
        return out.set_(storage, 0, local.shape)


def sharded_dtensor(local: torch.Tensor, layout: ParamLayout, mesh: DeviceMesh) -> DTensor:
    """``local`` (this rank's rows) as the DTensor of the whole parameter."""
    local = at_storage_start(local)
    shape = torch.Size(layout.shape)
    stride = _contiguous_stride(layout.shape)
    return DTensor.from_local(local, mesh, placements(mesh), run_check=False, shape=shape,
                              stride=stride)


def sharded_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as a DTensor with ``like``'s global shape, mesh and placements (no checks and no
    autograd: for gradients, made every step)."""
    return DTensor(at_storage_start(local), like._spec, requires_grad=False)


def sharded_parameter(local: torch.Tensor, layout: ParamLayout, mesh: DeviceMesh,
                      requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(sharded_dtensor(local, layout, mesh), requires_grad=requires_grad)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local part of ``t`` if it is a DTensor, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def set_local_tensor(param: nn.Parameter, local: torch.Tensor) -> None:
    """Point a DTensor parameter at a new local tensor (same shape and dtype)."""
    param._local_tensor = at_storage_start(local)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, at = [], 1
    for size in reversed(shape):
        stride.append(at)
        at *= max(size, 1)
    return tuple(reversed(stride))
