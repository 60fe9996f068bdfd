"""Validation of what is wrapped, with errors that name the offending parameters."""

from __future__ import annotations

import torch
from torch import nn


def class_name(module: nn.Module) -> str:
    """The module's own class name (not the ``FSDP...`` class fully_shard gives it)."""
    return getattr(type(module), "_fsdp_orig_cls", type(module)).__name__


def check_same_device(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> torch.device:
    """All of a unit's parameters must live on one device; return it."""
    devices: dict[torch.device, list[str]] = {}
    for name, p in named:
        devices.setdefault(p.device, []).append(name)
    if len(devices) > 1:
        where = "; ".join(f"{d}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                          for d, names in devices.items())
        raise ValueError(
            f"FSDP: the parameters of {class_name(module)} live on different devices "
            f"({where}); move the module to one device before wrapping it"
        )
    return next(iter(devices))


def check_same_dtype(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> torch.dtype:
    dtypes: dict[torch.dtype, list[str]] = {}
    for name, p in named:
        dtypes.setdefault(p.dtype, []).append(name)
    if len(dtypes) > 1:
        where = "; ".join(f"{d}: {', '.join(n[:4])}" for d, n in dtypes.items())
        raise ValueError(f"FSDP: the parameters of one unit ({class_name(module)}) must share "
                         f"a dtype to be flattened together, found {where}")
    dtype = next(iter(dtypes))
    if not dtype.is_floating_point:
        raise ValueError(f"FSDP shards floating-point parameters, {class_name(module)} has "
                         f"{dtype} parameters")
    return dtype


def check_backend_device(backend: str, device: torch.device, offload: bool) -> None:
    """NCCL moves only CUDA tensors: parameters must be on the GPU (CPU offload keeps the shards
    on the CPU but still computes and communicates on the GPU)."""
    if backend == "nccl" and device.type != "cuda":
        hint = ("CPU offload still needs the module on the GPU: it moves only the shards to the "
                "CPU" if offload else "move the module to its CUDA device")
        raise ValueError(
            f"FSDP: the process group uses NCCL, which communicates only CUDA tensors, but the "
            f"parameters are on {device}{' with cpu_offload' if offload else ''}; {hint}"
        )


def check_not_wrapped(module: nn.Module, attr: str) -> None:
    if getattr(module, attr, None) is not None:
        raise RuntimeError(
            f"fully_shard was already applied to this {class_name(module)}; applying it "
            "twice would shard its (already sharded) parameters again"
        )


def check_not_shared_with_child(name: str, param: nn.Parameter, child_ids: dict[int, str]
                                ) -> None:
    if id(param) in child_ids:
        raise ValueError(
            f"FSDP: parameter {name} is shared with {child_ids[id(param)]}, which belongs to a "
            "nested unit; shared (tied) parameters must belong to one unit, so wrap the modules "
            "that share it inside the same unit (e.g. keep both in the root)"
        )
