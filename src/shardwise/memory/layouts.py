"""Model-state bytes per rank on a 2D or 3D mesh: HSDP (replicas x shard) and FSDP x TP.

[Note: mesh state estimates]
The world is a mesh ``(replicas, shard, tp)``, row-major (docs/mesh.md): ``tp`` ranks split
each tensor-parallel weight (Megatron style, ``ChunkShardingSpec`` chunks as ``torch.chunk``:
the first ranks hold ``ceil(L / tp)`` rows of a dimension of length ``L``, the most any rank
holds), ``shard = world / (replicas * tp)`` ranks shard each FSDP unit of what one TP rank
holds (the unit flattened and padded to a multiple of ``shard``), and ``replicas`` copies of
that repeat across the replica dimension (HSDP). Per rank, with ``U_local`` the elements of a
unit that one TP rank holds:

    parameters = gradients = sum over units of ceil(U_local / shard) elements
    optimizer state        = that x K bytes + one per-tensor entry per unit (flat parameters)

``replicas = tp = 1`` is plain FSDP (``estimate_state_bytes(..., "fsdp")`` gives the same);
``shard = 1`` keeps whole (TP-local) units on every rank. Replicas cost no memory: they only
change which ranks hold the same bytes. The numbers are the rank holding the most (TP rank 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.memory.accounting import StateBytes
from shardwise.memory.estimate import OPTIMIZER_STATE, sharded_unit_bytes, state_element_bytes


@dataclass(frozen=True)
class ParamSize:
    """A parameter for planning: its elements and, when tensor parallelism splits it, the
    length of the split dimension (None: every TP rank holds it whole)."""

    numel: int
    tp_dim_len: int | None = None

    def local_numel(self, tp: int) -> int:
        """Elements the TP rank holding the largest chunk keeps."""
        if self.tp_dim_len is None or tp == 1:
            return self.numel
        if self.tp_dim_len < 1 or self.numel % self.tp_dim_len:
            raise ValueError(f"a parameter of {self.numel} elements cannot be split on a "
                             f"dimension of length {self.tp_dim_len}")
        return self.numel // self.tp_dim_len * math.ceil(self.tp_dim_len / tp)


@dataclass(frozen=True)
class MeshLayout:
    """How ``world_size`` ranks are arranged: ``(replicas, shard, tp)``, row-major."""

    world_size: int
    tp: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.world_size % (self.tp * self.replicas):
            raise ValueError(
                f"world size {self.world_size} is not divisible by replicas ({self.replicas}) x "
                f"tp ({self.tp}) = {self.replicas * self.tp}: the mesh (replicas, shard, tp) "
                "must fill the world"
            )

    @property
    def shard(self) -> int:
        """Ranks that shard each FSDP unit between them."""
        return self.world_size // (self.tp * self.replicas)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.replicas, self.shard, self.tp)


def estimate_mesh_state_bytes(units: Sequence[Sequence[ParamSize]], layout: MeshLayout, *,
                              optimizer: str = "adamw",
                              param_dtype: torch.dtype = torch.float32,
                              precision: str | None = None) -> StateBytes:
    """Bytes of model state one rank holds between steps; see [Note: mesh state estimates].

    ``units`` groups the trainable parameters as FSDP wraps them (one unit per wrapped
    module); each unit is split by TP first, then sharded and padded over the shard dimension.
    ``precision`` (fp32, bf16, mixed: see [Note: model-state estimates]) overrides
    ``param_dtype``. A pure function.
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE)}")
    element = state_element_bytes(optimizer, param_dtype, precision)
    local = [sum(p.local_numel(layout.tp) for p in u) for u in units]
    return sharded_unit_bytes(local, layout.shard, element)
