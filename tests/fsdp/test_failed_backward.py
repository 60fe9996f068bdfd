"""A backward that raises part-way (a hook, a check on every rank), caught by the user's loop,
must not leak into the steps after it ([Note: a backward that raised], root.py); nor may a
forward that raised leave units gathered.

Autograd runs no end-of-backward callback for a backward that raised, so without a check the
next forward looked like an activation-checkpoint recompute and the next backward queued no
callback: its gradients were then silently wrong (torch's FSDP2 gives the same wrong numbers).
Each test compares every step that completes with a one-process reference that skips the failed
step."""

import warnings

import pytest
import torch
from torch import nn

from shardwise import fully_shard
from shardwise._compat import DTensor
from shardwise.distributed import init_device_mesh
from shardwise.fsdp import reduction
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import WORLD_SIZES, local_part, run_on_ranks, shard0_rows
from tests.harness.failures import Injected, raise_in_backward

WIDTH = 512  # large enough for the direct exchange at world size 4 (see test_direct_reduction)
RTOL = 1e-5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _raise_in_forward(module, args, output):
    raise Injected("raised by a forward hook")


def _steps(ctx, mode: str, fail_at: int, save_in_handler: bool = False, where="backward"):
    """Four steps; in step 1 every rank's backward raises once the gradient of block
    ``fail_at``'s output is computed (the blocks after it and the head have theirs).
    ``mode``: "direct" or "flat-buffer" (how units reduce), or "hsdp" (a 2 x 2 mesh at world
    size 4: direct within a shard group, then an all-reduce across replicas).
    ``save_in_handler``: the handler takes a state dict, which must hold the shards.
    ``where="forward"``: block ``fail_at``'s forward raises instead."""
    original = reduction.direct_possible
    if mode == "flat-buffer":  # every unit reduces through its flat buffer (as with NCCL)
        reduction.direct_possible = lambda handle: False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run_steps(ctx, mode, fail_at, save_in_handler, where)
        return [str(w.message) for w in caught if "previous backward" in str(w.message)]
    finally:
        reduction.direct_possible = original


def _run_steps(ctx, mode: str, fail_at: int, save_in_handler: bool, where: str) -> None:
    torch.manual_seed(0)
    reference, model = Net(), Net()
    model.load_state_dict(reference.state_dict())
    kwargs = {}
    if mode == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, ctx.world_size // 2),
                                          mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        xs = torch.randn(ctx.world_size, 2, WIDTH, generator=gen)
        if step == 1:
            raiser = _raise_in_forward if where == "forward" else raise_in_backward
            hook = model.blocks[fail_at].register_forward_hook(raiser)
            with pytest.raises(Injected):
                model(xs[ctx.rank]).square().mean().backward()
            hook.remove()
            if save_in_handler:
                for key, value in model.state_dict().items():
                    assert isinstance(value, DTensor), f"{key}: {type(value).__name__}"
                    world = ctx.world_size // 2 if mode == "hsdp" else ctx.world_size
                    assert local_part(value).shape == shard0_rows(
                        reference.state_dict()[key], ctx.rank % world, world).shape, key
            model.zero_grad(set_to_none=True)
            continue
        reference.zero_grad()
        for x in xs:
            (reference(x).square().mean() / ctx.world_size).backward()
        model(xs[ctx.rank]).square().mean().backward()
        assert_unit_grads(model, reference, f"step {step}", RTOL)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("mode", ["direct", "flat-buffer"])
def test_steps_after_a_backward_that_raised_match_the_reference(world_size, mode):
    messages = run_on_ranks(world_size, _steps, mode, 0, timeout=60)
    assert messages == [messages[0]] * world_size and len(messages[0]) == 1, messages


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_state_dict_saved_in_the_handler_holds_the_shards(world_size):
    """The failed backward left the head and the later blocks gathered; a checkpoint taken in
    the exception handler must still see the sharded parameters (DTensors of this rank's
    rows), and the steps after it must match."""
    messages = run_on_ranks(world_size, _steps, "direct", 0, True, timeout=60)
    assert messages == [messages[0]] * world_size and len(messages[0]) == 1, messages


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_forward_that_raised_leaves_the_shards_in_place(world_size):
    """A forward that raised part-way (block 1's) leaves no unit gathered, with no collective
    (the post-forward hook registered with ``always_call``): a state dict in the handler holds
    the shards, and the steps after it match. Nothing is said: no backward was left open."""
    messages = run_on_ranks(world_size, _steps, "direct", 1, True, "forward", timeout=60)
    assert messages == [[]] * world_size, messages


@pytest.mark.parametrize("world_size", [4])
def test_hybrid_sharding_after_a_backward_that_raised(world_size):
    """HSDP (2 x 2): block 1's reduction is in flight when backward raises; its all-reduce
    across replicas, issued only by a wait, is left out on every rank alike, and the state
    dict and the steps after it are right."""
    messages = run_on_ranks(world_size, _steps, "hsdp", 0, True, timeout=60)
    assert messages == [messages[0]] * world_size and len(messages[0]) == 1, messages


@pytest.mark.parametrize("world_size", [2])
def test_a_backward_that_raised_before_any_unit_reduced(world_size):
    """The hook on the last block's output raises before any block's reduction was issued
    (only the head's gradients are in): nothing is in flight to finish."""
    run_on_ranks(world_size, _steps, "direct", 2, timeout=60)
