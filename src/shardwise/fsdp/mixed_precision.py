"""The configuration values of FSDP: mixed precision and CPU offload (torch's names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and communication; sharded master parameters stay in their own dtype.

    ``param_dtype``: the dtype parameters are all-gathered in and forward/backward compute with
    (None: the parameters' own dtype). ``reduce_dtype``: the dtype gradients are reduce-scattered
    in (None: ``param_dtype``). ``buffer_dtype``: buffers are cast to it once at wrap time
    (None: unchanged). ``cast_forward_inputs``: floating-point tensors passed to a unit's forward
    are cast to ``param_dtype``. The optimizer always steps on the full-precision shards.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype)
                                          and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {value!r}")


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps the sharded parameters and their gradients in CPU memory
    (so the optimizer steps there); each unit's shard is copied to the compute device just
    before its all-gather, and each reduced gradient shard is copied back to the CPU."""

    offload_params: bool = False


def resolve_dtypes(mp: MixedPrecision | None, own: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """``(param_dtype, reduce_dtype)`` for parameters whose own dtype is ``own``."""
    param = (mp.param_dtype if mp and mp.param_dtype else None) or own
    reduce = (mp.reduce_dtype if mp and mp.reduce_dtype else None) or param
    return param, reduce
