"""torch FSDP2's gradient divide factor: ``set_gradient_divide_factor(f)`` makes a unit's
gradients the sum over its data-parallel ranks divided by ``f`` instead of their mean (torchtitan
sets 1.0 and divides the loss by the global token count itself). Checked against a one-process
reference (every rank's loss summed, divided by ``f``) and against torch's own FSDP2, on one
unit per block and on the root, with hybrid sharding too."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import fully_shard
from shardwise.distributed import init_device_mesh
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

RTOL = 1e-5
WIDTH = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def _shard(model: Net, shard_fn, mesh=None) -> None:
    kwargs = {} if mesh is None else {"mesh": mesh}
    shard_fn(model.blocks, **kwargs)
    shard_fn(model, **kwargs)


def _set_factor(model: nn.Module, factor: float) -> None:
    for module in model.modules():  # torchtitan's loop: the method is per module, as torch's
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(factor)


def _train(ctx, factor: float, hybrid: bool) -> None:
    torch.manual_seed(0)
    reference, model = Net(), Net()
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2)) if hybrid else None
    _shard(model, fully_shard, mesh)
    _set_factor(model, factor)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        xs = torch.randn(ctx.world_size, 4, WIDTH, generator=gen)
        ref_opt.zero_grad()
        opt.zero_grad()
        for x in xs:  # the sum over ranks, divided by the factor
            (reference(x).square().mean() / factor).backward()
        model(xs[ctx.rank]).square().mean().backward()
        assert_unit_grads(model, reference, f"factor {factor}, step {step}", RTOL)
        ref_opt.step()
        opt.step()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_gradients_are_the_sum_over_ranks_divided_by_the_factor(world_size, factor):
    run_on_ranks(world_size, _train, factor, False)


def test_hybrid_sharding_divides_the_sum_over_every_replica_and_shard():
    run_on_ranks(4, _train, 1.0, True)


def _grads(ctx, which: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    if which == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        _shard(model, torch_fully_shard)
    else:
        _shard(model, fully_shard)
    _set_factor(model, 1.0)
    model.set_reduce_scatter_divide_factor(1.0)  # torch's older name, the same setting
    if which == "torch":  # torch's FSDP2 needs SUM-only collectives for a factor on gloo
        for module in (model.blocks, model):  # ("Cannot use ReduceOp.PREMUL_SUM with Gloo")
            module.set_force_sum_reduction_for_comms(True)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    model(x).square().mean().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def test_the_same_gradients_as_torchs_fsdp2():
    ours, theirs = run_on_ranks(2, _grads, "shardwise"), run_on_ranks(2, _grads, "torch")
    for rank in range(2):
        for mine, torch_grad in zip(ours[rank], theirs[rank], strict=True):
            assert_rel_close(mine, torch_grad, RTOL, f"rank {rank}")


def _bad_factor(ctx, factor):
    model = Net()
    _shard(model, fully_shard)
    try:
        model.set_gradient_divide_factor(factor)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), True, "2"])
def test_a_factor_that_is_not_a_positive_number_is_refused_by_name(factor):
    message = run_on_ranks(1, _bad_factor, factor)[0]
    assert message is not None and "set_gradient_divide_factor" in message
    assert repr(factor) in message


def _warned(ctx):
    import warnings

    model = Net()
    _shard(model, fully_shard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_force_sum_reduction_for_comms(True)
    return [str(w.message) for w in caught], dist.get_world_size()


def test_force_sum_reduction_is_accepted_and_warns_that_it_changes_nothing():
    messages, _ = run_on_ranks(1, _warned)[0]
    assert len(messages) == 1 and "no effect" in messages[0]
