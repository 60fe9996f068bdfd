"""Each FSDP unit's sharded gradients against a one-process reference's gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.fsdp import units_of
from tests.harness import assert_rel_close, local_part, shard0_rows


def assert_unit_grads(model: nn.Module, reference: nn.Module, what: str, rtol: float) -> None:
    """Every unit's sharded gradient equals this rank's rows (in its unit's group) of the
    reference parameter's gradient; None where the reference has none (a parameter no rank
    used), zeros there under ``set_reduce_scatter_unused_params(True)``."""
    ref = dict(reference.named_parameters())
    names = {id(m): n for n, m in model.named_modules()}
    for unit in units_of(model):
        rank, world = dist.get_rank(unit.group), dist.get_world_size(unit.group)
        for slot in unit.handle.slots:
            home = unit.modules[slot.homes[0] if slot.homes else 0]  # the module naming it
            prefix = f"{names[id(home)]}." if names[id(home)] else ""
            expected = ref[prefix + slot.fqns[0]].grad
            if expected is None and not unit.reduce_scatter_unused_params:
                assert slot.shard_param.grad is None, f"{what}: {prefix + slot.fqns[0]} unused"
                continue
            if expected is None:
                expected = torch.zeros(slot.shape)
            assert slot.shard_param.grad is not None, f"{what}: {prefix + slot.fqns[0]} lost it"
            assert_rel_close(local_part(slot.shard_param.grad), shard0_rows(expected, rank, world),
                             rtol, f"{what}: {prefix + slot.fqns[0]}")
