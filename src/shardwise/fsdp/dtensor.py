"""FSDP's sharded parameters as torch DTensors (``Shard(0)`` on a 1D mesh of the unit's group;
``(Replicate(), Shard(0))`` on a 2D mesh for hybrid sharding).

Presenting each local shard as a ``DTensor`` is what makes torch's own code work on a sharded
model without special cases: ``torch.nn.utils.clip_grad_norm_`` reduces the partial norms across
ranks, ``full_tensor()`` gathers, DCP's state-dict helpers and ``distribute_tensor`` see global
shapes, and ``reset_parameters()`` computes fan-in from the global shape. The local tensor of
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

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise._compat import DTensor, Replicate, Shard
from shardwise.distributed.groups import collective_device
from shardwise.fsdp.layout import ParamLayout


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
