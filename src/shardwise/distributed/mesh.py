"""``init_device_mesh``: torch's own ``DeviceMesh``, built from process groups we create.

The returned object is a ``torch.distributed.device_mesh.DeviceMesh`` (so DTensor, FSDP's
``fully_shard(mesh=...)`` and any torch code accept it), made with ``DeviceMesh.from_group`` from
one process group per dimension. We create those groups ourselves, instead of letting torch's
``init_device_mesh`` do it, for three reasons: every group carries the library's timeout
(``SHARDWISE_TIMEOUT`` or ``timeout=``), a bad shape is an error that shows every factor before
any group exists, and each dimension's groups are created exactly once, in the rank order of
[Note: mesh rank order] (topology.py). Slicing (``mesh["dp"]``, ``mesh["dp", "tp"]``) reuses
these groups and creates none. See docs/mesh.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise._compat import clear_mesh_dim_names
from shardwise.distributed.env import int_var
from shardwise.distributed.init import init, pick_backend
from shardwise.distributed.timeouts import as_timedelta
from shardwise.distributed.topology import (
    InvalidMeshError,
    check_dim_names,
    check_mesh_shape,
    dim_groups,
)

__all__ = ["DeviceMesh", "init_device_mesh"]

# (backend name or None: the default group's, backend options or None)
BackendConfig = tuple[str | None, Any]

_HAS_GROUP_DESC = "group_desc" in inspect.signature(dist.new_group).parameters


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    backend_override: Mapping[int | str, Any] | None = None,
    timeout: float | timedelta | None = None,
) -> DeviceMesh:
    """A ``DeviceMesh`` of ``mesh_shape`` over all ranks, row-major like torch's.

    Starts the default group first (``shardwise.distributed.init``: torchrun's or
    ``shardwise run``'s environment) when none exists. Then, for each dimension, every rank
    calls ``new_group`` once per group of that dimension (collective over the world, in the same
    order on every rank), each group with ``timeout`` (default: ``SHARDWISE_TIMEOUT`` or 300 s);
    a dimension that spans the whole world reuses the default group, as torch's does.

    ``backend_override`` is torch's: ``{dim index or name: backend | options | (backend,
    options)}``. ``timeout`` is ours. Raises ``InvalidMeshError`` (a ValueError) when the shape's
    product is not the world size, or the names are repeated or do not match the shape.
    """
    if not isinstance(device_type, str) or not device_type.isalpha():
        raise InvalidMeshError(f"device_type must be a device type such as 'cpu' or 'cuda', "
                               f"without an index, got {device_type!r}")
    shape = tuple(mesh_shape)
    names = check_dim_names(mesh_dim_names, len(shape))
    overrides = _normalize_overrides(backend_override, len(shape), names)
    group_timeout = as_timedelta(timeout)
    if not dist.is_initialized():
        init(pick_backend(device_type), timeout=group_timeout)
    shape = check_mesh_shape(shape, dist.get_world_size())
    _select_device(device_type)
    groups = [_dim_group(shape, d, _dim_label(names, d), overrides[d], group_timeout)
              for d in range(len(shape))]
    return _from_groups(groups, device_type, shape, names)


def _dim_group(shape: tuple[int, ...], dim: int, label: str, override: BackendConfig,
               timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group along ``dim``; every group of the dimension is created (by all ranks,
    in the same order) exactly once."""
    rank = dist.get_rank()
    groups = dim_groups(shape, dim)
    if len(groups) == 1 and override == (None, None):
        return dist.group.WORLD  # the whole world: the default group already is this group
    backend, options = override
    extra = {"group_desc": f"mesh_{label}"} if _HAS_GROUP_DESC else {}
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend,
                               pg_options=options, **extra)
        if rank in ranks:
            mine = group
    if mine is None:  # cannot happen: the groups of a dimension cover every rank
        raise RuntimeError(f"rank {rank} is in no group of mesh dimension {label}")
    return mine


def _from_groups(groups: list[dist.ProcessGroup], device_type: str, shape: tuple[int, ...],
                 names: tuple[str, ...] | None) -> DeviceMesh:
    if len(groups) == 1 and names is None:
        return DeviceMesh.from_group(groups[0], device_type)
    ranks = torch.arange(math.prod(shape), dtype=torch.int).reshape(shape)
    # from_group wants names for more than one group; an unnamed mesh gets placeholder names
    # that are removed again, so that mesh_dim_names is None as with torch's init_device_mesh
    given = names or tuple(f"dim_{d}" for d in range(len(shape)))
    mesh = DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=given)
    if names is None:
        clear_mesh_dim_names(mesh)
    return mesh


def _dim_label(names: tuple[str, ...] | None, dim: int) -> str:
    return names[dim] if names else f"dim_{dim}"


def _normalize_overrides(overrides: Mapping[int | str, Any] | None, ndim: int,
                         names: tuple[str, ...] | None) -> list[BackendConfig]:
    """torch's ``backend_override`` as one ``(backend, options)`` pair per dimension."""
    out: list[BackendConfig] = [(None, None)] * ndim
    for key, value in (overrides or {}).items():
        dim = _override_dim(key, ndim, names)
        if out[dim] != (None, None):
            raise InvalidMeshError(f"backend_override names mesh dimension {dim} twice")
        if isinstance(value, str):
            out[dim] = (value, None)
        elif isinstance(value, tuple) and len(value) == 2:
            out[dim] = (value[0], value[1])
        else:
            out[dim] = (None, value)  # backend options for the default backend
    return out


def _override_dim(key: int | str, ndim: int, names: tuple[str, ...] | None) -> int:
    if isinstance(key, str):
        if names is None or key not in names:
            raise InvalidMeshError(f"backend_override names dimension {key!r}, but the mesh "
                                   f"dimensions are {names}")
        return names.index(key)
    if not -ndim <= key < ndim:
        raise InvalidMeshError(f"backend_override names dimension {key}, but the mesh has "
                               f"{ndim} dimensions")
    return key % ndim


def _select_device(device_type: str) -> None:
    """Pick this rank's accelerator by LOCAL_RANK when the caller has not (as torch's
    DeviceMesh does), so that NCCL groups are made on the right device."""
    if device_type != "cuda" or not torch.cuda.is_available() or torch.cuda.is_initialized():
        return
    local_rank = int_var("LOCAL_RANK", default=dist.get_rank(), minimum=0)
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
