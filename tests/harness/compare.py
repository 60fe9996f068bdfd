"""Comparing distributed results with a single-process reference.

"Relative tolerance" here is relative to the tensor's scale: ``max|a - b| <= rtol * max|b|``
(plus a tiny absolute floor for all-zero tensors). Element-wise relative error is meaningless for
elements near zero, which Adam-style updates produce in every tensor: two runs that differ only
in the order of a sum can give 1e-9 and -1e-9 there.
"""

from __future__ import annotations

import torch

ABS_FLOOR = 1e-12


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|`` (0 for two empty tensors)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, ABS_FLOOR)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float,
                     what: str = "tensor") -> None:
    diff = max_rel_diff(actual, expected)
    if not diff <= rtol:
        raise AssertionError(
            f"{what}: max difference is {diff:.3g} of its scale (allowed {rtol:g})"
        )


def assert_state_close(actual: dict, expected: dict, rtol: float) -> None:
    """Every tensor of two state dicts (same keys) within ``rtol`` of its scale."""
    missing, extra = expected.keys() - actual.keys(), actual.keys() - expected.keys()
    if missing or extra:
        raise AssertionError(f"state keys differ: missing {sorted(missing)}, extra {sorted(extra)}")
    for key, value in expected.items():
        assert_rel_close(actual[key], value, rtol, key)


def shard0_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The rows of ``full`` that ``rank`` owns under ``Shard(0)`` (torch.chunk's split: the last
    ranks may own fewer rows, or none)."""
    chunks = full.chunk(world_size, 0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t
