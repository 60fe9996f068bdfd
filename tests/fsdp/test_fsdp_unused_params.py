"""A unit with a parameter that forward does not use: its gradient never arrives, so the unit's
backward is not complete when autograd finishes; the end-of-backward callback must still reduce
the gradients that did arrive (zero for the unused parameter), in the same order on every rank."""

import pytest
import torch
from torch import nn

from shardwise import fully_shard
from shardwise.fsdp import units_of, unsharded_bytes, unsharded_grad_bytes
from tests.harness import WORLD_SIZES, assert_rel_close, local_part, run_on_ranks, shard0_rows

RTOL = 1e-5


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)  # never called

    def forward(self, x):
        return torch.tanh(self.used(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = PartlyUsed(), nn.Linear(8, 8)

    def forward(self, x):
        return self.second(self.first(x))


def _train(ctx):
    torch.manual_seed(0)
    reference, model = Net(), Net()
    model.load_state_dict(reference.state_dict())
    fully_shard(model.first)
    fully_shard(model)
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        xs = torch.randn(ctx.world_size, 4, 8, generator=gen)
        reference.zero_grad()
        for x in xs:
            (reference(x).square().mean() / ctx.world_size).backward()
        model.zero_grad()
        model(xs[ctx.rank]).square().mean().backward()
        assert unsharded_bytes(model) == 0 and unsharded_grad_bytes(model) == 0
        ref = dict(reference.named_parameters())
        for unit in units_of(model):
            prefix = "first." if unit.module is model.first else ""
            for slot in unit.handle.slots:
                expected = ref[prefix + slot.fqns[0]].grad
                if expected is None:  # the unused parameter: a zero gradient shard
                    expected = torch.zeros(slot.shape)
                assert_rel_close(local_part(slot.shard_param.grad),
                                 shard0_rows(expected, ctx.rank, ctx.world_size), RTOL,
                                 f"step {step}: {prefix + slot.fqns[0]}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unit_with_an_unused_parameter_reduces_the_gradients_that_arrived(world_size):
    run_on_ranks(world_size, _train)
