"""Parameters that forward does not use ([Note: gradients of unused parameters],
fsdp/reduction.py). Every rank reduces every parameter of a unit, with zeros for the ones it
got no gradient for; a parameter that no rank used keeps ``grad is None``, as in the one-process
reference and torch's FSDP2, so AdamW leaves it alone. Before, it got a zero gradient, and AdamW
decayed it and moved it with its old moments: the parameters drifted from the reference's."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import fully_shard
from shardwise.distributed import init_device_mesh
from shardwise.fsdp import unsharded_bytes, unsharded_grad_bytes
from tests.fsdp.gathering import gathering_units
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

RTOL = 1e-5
WIDTH = 8


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH)
        self.branch = nn.Linear(WIDTH, WIDTH)  # used on the ranks the step asks for
        self.unused = nn.Linear(WIDTH, WIDTH)  # never called

    def forward(self, x, branch: bool):
        h = torch.tanh(self.used(x))
        return h + self.branch(h) if branch else h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = PartlyUsed(), nn.Linear(WIDTH, WIDTH)
        self.pooler = nn.Linear(WIDTH, WIDTH)  # in the root unit, never called

    def forward(self, x, branch: bool = False):
        return self.second(self.first(x, branch))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard(model: nn.Module, mode: str) -> None:
    kwargs = {}
    if mode == "hsdp":  # (replicate, shard) = 2 x 2
        kwargs["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                          mesh_dim_names=("replicate", "shard"))
    with gathering_units() if mode == "gathering" else contextlib.nullcontext():
        fully_shard(model.first, **kwargs)
        fully_shard(model, **kwargs)


def _branch_ranks(step: int, world: int) -> set[int]:
    """Step 0: no rank runs the branch; step 1: the last rank only; step 2: every rank."""
    return [set(), {world - 1}, set(range(world))][step % 3]


def _train(ctx, mode: str, zero_grad: bool) -> None:
    torch.manual_seed(0)
    reference, model = Net(), Net()
    model.load_state_dict(reference.state_dict())
    _shard(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        xs = torch.randn(ctx.world_size, 4, WIDTH, generator=gen)
        branch = _branch_ranks(step, ctx.world_size)
        if zero_grad:
            ref_opt.zero_grad()
            opt.zero_grad()
        for r, x in enumerate(xs):
            (reference(x, r in branch).square().mean() / ctx.world_size).backward()
        model(xs[ctx.rank], ctx.rank in branch).square().mean().backward()
        assert unsharded_bytes(model) == 0 and unsharded_grad_bytes(model) == 0
        assert_unit_grads(model, reference, f"{mode}, step {step}", RTOL)
        ref_opt.step()
        opt.step()
    mine = dict(model.named_parameters())
    for name, p in reference.named_parameters():  # AdamW left the unused ones alone
        assert_rel_close(_full(mine[name]).detach(), p.detach(), RTOL, f"{mode}: {name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_parameter_no_rank_used_keeps_grad_none_and_adamw_matches(world_size):
    run_on_ranks(world_size, _train, "shared", True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_same_where_units_gather(world_size):
    run_on_ranks(world_size, _train, "gathering", True)


def test_hybrid_sharding_agrees_across_replicas():
    """Step 1 runs the branch on the last rank only: its shard group holds the gradient, the
    other shard group learns of it from the replicas."""
    run_on_ranks(4, _train, "hsdp", True)


def test_gradients_kept_from_an_earlier_step_are_not_dropped():
    """No ``zero_grad``: the branch's gradient of step 1 stays in ``.grad`` through step 3,
    where no rank uses it again, as the reference's does."""
    run_on_ranks(2, _train, "shared", False)


def _zero_grads_when_asked(ctx, which: str) -> list[bool]:
    torch.manual_seed(0)
    model = Net()
    if which == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model.first)
        torch_fully_shard(model)
    else:
        _shard(model, "shared")
    model.set_reduce_scatter_unused_params(True)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    grads = [model.pooler.weight.grad, model.first.unused.weight.grad]
    return [g is not None and bool((_full(g) == 0).all()) for g in grads]


@pytest.mark.parametrize("which", ["shardwise", "torch"])
def test_set_reduce_scatter_unused_params_true_gives_zero_gradients_as_torch(which):
    assert run_on_ranks(2, _zero_grads_when_asked, which) == [[True, True]] * 2
