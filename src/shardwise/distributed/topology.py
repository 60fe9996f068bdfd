"""Rank order of a device mesh, as pure functions (no process group needed).

[Note: mesh rank order]
A mesh of shape ``(s0, s1, ..., sk)`` lays the global ranks ``0 .. prod(shape) - 1`` out in
row-major order, as ``torch.arange(world).reshape(shape)`` does and as torch's
``init_device_mesh`` does: the last dimension varies fastest. Along dimension ``d``, the ranks
that share a process group are those whose coordinates differ only in ``d``; with shape (2, 4)
dimension 0 groups ranks ``{0, 4}, {1, 5}, {2, 6}, {3, 7}`` and dimension 1 groups
``{0, 1, 2, 3}, {4, 5, 6, 7}``. Groups of one dimension are listed by their lowest rank, the
order in which every rank creates them (``new_group`` must be called in the same order
everywhere). With torchrun's numbering (the ranks of a node are consecutive), the last
dimension stays inside a node when its size divides the ranks per node: hence the default
hybrid layout puts the sharding (or tensor-parallel) dimension last, with one row per node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardwise.distributed.env import int_var

HSDP_DIM_NAMES = ("replicate", "shard")  # HSDP: replicate across nodes, shard within one
TP_DIM_NAMES = ("dp", "tp")  # FSDP x TP: data parallel across nodes, tensor parallel within


class InvalidMeshError(ValueError, RuntimeError):
    """A mesh shape or its dimension names do not fit (a ValueError; also a RuntimeError, which
    is what torch's ``init_device_mesh`` raises for the same mistakes)."""


def check_mesh_shape(mesh_shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of positive ints whose product is ``world_size``."""
    shape = tuple(mesh_shape)
    if not shape:
        raise InvalidMeshError("mesh_shape must have at least one dimension, got ()")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
        raise InvalidMeshError(f"mesh_shape must hold positive ints, got {shape}")
    if math.prod(shape) != world_size:
        factors = " x ".join(str(s) for s in shape)
        raise InvalidMeshError(
            f"mesh_shape {shape} has {factors} = {math.prod(shape)} ranks, but the world size "
            f"is {world_size}: the product of the mesh dimensions must equal the world size"
        )
    return shape


def check_dim_names(mesh_dim_names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    """Names as a tuple: one distinct, non-empty string per mesh dimension (or None)."""
    if mesh_dim_names is None:
        return None
    if isinstance(mesh_dim_names, str):
        raise InvalidMeshError(f"mesh_dim_names must be a tuple of names, got the string "
                               f"{mesh_dim_names!r} (write ({mesh_dim_names!r},))")
    names = tuple(mesh_dim_names)
    if len(names) != ndim:
        raise InvalidMeshError(f"mesh_dim_names {names} has {len(names)} names for a mesh of "
                               f"{ndim} dimensions")
    if not all(isinstance(n, str) and n for n in names):
        raise InvalidMeshError(f"mesh_dim_names must be non-empty strings, got {names}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidMeshError(f"mesh_dim_names {names} repeats {repeated}: each dimension "
                               "needs its own name")
    return names


def mesh_ranks(mesh_shape: Sequence[int]) -> list:
    """The nested list of global ranks, row-major: ``mesh_ranks((2, 2)) == [[0, 1], [2, 3]]``."""
    shape = tuple(mesh_shape)
    flat = list(range(math.prod(shape)))
    for size in reversed(shape[1:]):
        flat = [flat[i : i + size] for i in range(0, len(flat), size)]
    return flat


def strides(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides: how far apart in rank two neighbours along each dimension are."""
    out, step = [], 1
    for size in reversed(tuple(mesh_shape)):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def coordinate(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Coordinates of global ``rank`` in the mesh (row-major)."""
    shape = tuple(mesh_shape)
    if not 0 <= rank < math.prod(shape):
        raise ValueError(f"rank {rank} is outside a mesh of shape {shape}")
    return tuple((rank // st) % size for size, st in zip(shape, strides(shape)))


def dim_groups(mesh_shape: Sequence[int], dim: int) -> list[tuple[int, ...]]:
    """Every group of global ranks along ``dim``, in order of their lowest rank; each group
    lists its ranks in order of their coordinate on ``dim`` (its group rank)."""
    shape = tuple(mesh_shape)
    if not -len(shape) <= dim < len(shape):
        raise IndexError(f"dim {dim} is out of range for a mesh of {len(shape)} dimensions")
    dim %= len(shape)
    step = strides(shape)[dim]
    starts = [r for r in range(math.prod(shape)) if coordinate(r, shape)[dim] == 0]
    return [tuple(s + i * step for i in range(shape[dim])) for s in starts]


def group_of(rank: int, mesh_shape: Sequence[int], dim: int) -> tuple[int, ...]:
    """The global ranks that share ``rank``'s group along ``dim``."""
    return next(g for g in dim_groups(mesh_shape, dim) if rank in g)


def hybrid_mesh_shape(world_size: int, local_world_size: int) -> tuple[int, int]:
    """``(nodes, ranks per node)``: the default 2D layout for HSDP (replicate across nodes,
    shard within a node; names ``HSDP_DIM_NAMES``) and for FSDP x TP (``TP_DIM_NAMES``)."""
    if world_size < 1 or local_world_size < 1:
        raise InvalidMeshError(f"world size ({world_size}) and local world size "
                               f"({local_world_size}) must be positive")
    if world_size % local_world_size:
        raise InvalidMeshError(
            f"world size {world_size} is not a multiple of the ranks per node "
            f"({local_world_size}): a hybrid mesh needs every node to hold the same number of "
            "ranks"
        )
    return (world_size // local_world_size, local_world_size)


def local_world_size_from_env(world_size: int) -> int:
    """Ranks per node as torchrun sets it (``LOCAL_WORLD_SIZE``); ``world_size`` when unset
    (a single node)."""
    return int_var("LOCAL_WORLD_SIZE", default=world_size, minimum=1)


def node_of(rank: int, local_world_size: int) -> int:
    """The node of global ``rank`` when every node runs ``local_world_size`` consecutive ranks
    (torchrun's numbering)."""
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be positive, got {local_world_size}")
    return rank // local_world_size
