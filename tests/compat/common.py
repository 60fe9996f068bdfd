"""Running one small program with torch's DistributedDataParallel and with ours.

A compat test writes the program once, in torch's documented idioms, with the DDP class as a
parameter (``"torch"`` or ``"ours"``, resolved on the rank), runs it both ways in the same pool
processes (gloo on CPU), and compares both results with each other and with a single-process
reference.
"""

from __future__ import annotations

import torch
from torch import nn

import shardwise
from tests.harness import assert_rel_close

IMPLS = ("torch", "ours")


def ddp_class(impl: str) -> type:
    if impl == "torch":
        return torch.nn.parallel.DistributedDataParallel
    if impl == "ours":
        return shardwise.DistributedDataParallel
    raise ValueError(impl)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_close(actual: dict, expected: dict, rtol: float, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: keys differ"
    for key, value in expected.items():
        assert_rel_close(actual[key], value, rtol, f"{what}: {key}")
