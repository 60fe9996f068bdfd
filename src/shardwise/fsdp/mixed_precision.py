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
        _check_floating(self, ("param_dtype", "reduce_dtype", "buffer_dtype"))


def _check_floating(policy: object, names: tuple[str, ...]) -> None:
    """Each named field is None or a floating-point dtype (else a ValueError naming it)."""
    for name in names:
        value = getattr(policy, name)
        if value is not None and not (isinstance(value, torch.dtype)
                                      and value.is_floating_point):
            raise ValueError(f"{type(policy).__name__}.{name} must be a floating dtype, got "
                             f"{value!r}")


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


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch FSDP2's mixed-precision policy (``fully_shard(mp_policy=...)``).

    ``param_dtype``: the dtype parameters are all-gathered in and computed with;
    ``reduce_dtype``: the dtype gradients are reduce-scattered in (None: ``param_dtype``);
    ``output_dtype``: floating-point forward outputs are cast to it (None: unchanged);
    ``cast_forward_inputs``: floating-point inputs are cast to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        _check_floating(self, ("param_dtype", "reduce_dtype", "output_dtype"))


@dataclass(frozen=True)
class OffloadPolicy:
    """torch FSDP2's default: no offloading."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and so the optimizer state in CPU memory (see
    ``CPUOffload``). ``pin_memory`` pins them (CUDA only; ignored on a CPU-only machine)."""

    pin_memory: bool = True


def as_mixed_precision(policy: object) -> MixedPrecision | MixedPrecisionPolicy | None:
    """Our policy for ``policy``: ours, torch's ``MixedPrecisionPolicy`` or ``MixedPrecision``
    (read by their attributes), or None."""
    if policy is None or isinstance(policy, MixedPrecision | MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if all(hasattr(policy, f) for f in fields):
        return MixedPrecisionPolicy(*(getattr(policy, f) for f in fields))
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}")


def offloads_params(policy: object) -> bool:
    """Whether an offload policy (ours, torch's, or ``CPUOffload``) keeps shards on the CPU."""
    if policy is None:
        return False
    if isinstance(policy, CPUOffload):
        return policy.offload_params
    name = type(policy).__name__
    if name == "CPUOffloadPolicy":
        return True
    if name == "OffloadPolicy":
        return False
    raise TypeError(f"offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {name}")
