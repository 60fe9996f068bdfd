"""How training loops call the model, each against the one-process reference, with the units
gathering their parameters (as across hosts or with NCCL) and with the parameters shared on
one host: two forwards before one backward (a siamese or contrastive loss, DPO's chosen and
rejected answers), two backwards through one forward (``retain_graph``), a forward whose
output is dropped (an evaluation with grad enabled) before the training step, the gradient
with respect to the input (saliency, adversarial steps) and a gradient penalty through it.

A unit's backward ends once every counted forward's inputs have their gradients ([Note: where
a unit's backward ends], unit.py). Resetting that count at each forward of the root made the
second of two forwards forget the first: the unit resharded after one of them, and the other's
backward read freed parameters ("setStorage ... storage of size 0") wherever units gather."""

from __future__ import annotations

import contextlib

import pytest
import torch

from shardwise import fully_shard
from shardwise.fsdp.unit import FSDPUnit
from tests.fsdp.gathering import gathering_units
from tests.fsdp.test_failed_backward import WIDTH, Net  # three blocks and a head
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import run_on_ranks

RTOL = 1e-5


def _losses(model, x0, x1, pattern: str, scale: float = 1.0) -> None:
    """Run ``pattern``'s forwards and backwards of ``model`` on two inputs, each loss times
    ``scale``."""
    if pattern == "two forwards":
        ((model(x0) * model(x1)).mean() * scale).backward()
    elif pattern == "two backwards":
        out = model(x0)
        (out.square().mean() * scale).backward(retain_graph=True)
        (out.abs().mean() * scale).backward()
    elif pattern == "dropped forward":
        model(x1)  # its graph is dropped unused
        (model(x0).square().mean() * scale).backward()
    elif pattern == "input gradient":  # a saliency map or an adversarial step: d out / d x
        x = x0.clone().requires_grad_(True)
        out = model(x)
        torch.autograd.grad(out.sum(), x, retain_graph=True)
        (out.square().mean() * scale).backward()
    else:  # "gradient penalty" (R1): the loss differentiates through d out / d x
        x = x0.clone().requires_grad_(True)
        out = model(x)
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        ((out.square().mean() + grad.square().mean()) * scale).backward()


def _train(ctx, pattern: str, gather: bool) -> None:
    torch.manual_seed(0)
    reference, model = Net(), Net()
    model.load_state_dict(reference.state_dict())
    with gathering_units() if gather else contextlib.nullcontext():
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        xs = torch.randn(ctx.world_size, 2, 2, WIDTH, generator=gen)
        reference.zero_grad()
        for x0, x1 in xs:  # every rank's losses, averaged as the reduction averages
            _losses(reference, x0, x1, pattern, 1 / ctx.world_size)
        model.zero_grad()
        _losses(model, xs[ctx.rank, 0], xs[ctx.rank, 1], pattern)
        assert_unit_grads(model, reference, f"{pattern}, step {step}", RTOL)


CASES = [(1, True), (2, True), (4, True), (2, False), (4, False)]  # (world size, gather)


@pytest.mark.parametrize("world_size,gather", CASES)
def test_two_forwards_before_one_backward(world_size, gather):
    run_on_ranks(world_size, _train, "two forwards", gather, timeout=60)


@pytest.mark.parametrize("world_size,gather", CASES[:3] + CASES[3:4])
def test_a_gradient_penalty_through_the_input_gradient(world_size, gather):
    """``autograd.grad(..., create_graph=True)`` first: the units stay gathered for the graph
    it builds ([Note: backward with create_graph], unit.py). Failed before on freed storage
    wherever units gather, as torch's FSDP2 does; ``autograd.grad`` of a leaf input failed
    everywhere ("A leaf node was passed to _will_engine_execute_node")."""
    run_on_ranks(world_size, _train, "gradient penalty", gather, timeout=60)


@pytest.mark.parametrize("world_size,gather", [(2, True), (2, False)])
@pytest.mark.parametrize("pattern", ["two backwards", "dropped forward", "input gradient"])
def test_other_patterns(world_size, gather, pattern):
    run_on_ranks(world_size, _train, pattern, gather, timeout=60)


def _backward_with_create_graph(ctx) -> str:
    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    with pytest.raises(RuntimeError, match="not differentiable") as raised:
        model(torch.randn(2, WIDTH)).square().mean().backward(create_graph=True)
    return str(raised.value)


def test_parameter_gradients_with_a_graph_are_refused_with_the_reason():
    messages = run_on_ranks(2, _backward_with_create_graph, timeout=60)
    assert all("create_graph=True" in m for m in messages), messages


def _units_ended_at_the_callback(ctx) -> list[list[str]]:
    """Per step (an evaluation forward with grad enabled, its output dropped, then a training
    step), the units whose backward ended only at the end-of-backward callback."""
    torch.manual_seed(0)
    model = Net()
    with gathering_units():
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    names = {id(m): n or "root" for n, m in model.named_modules()}
    ended, original = [], FSDPUnit.end_backward_at_callback

    def counting(unit):
        ended[-1].append(names[id(unit.module)])
        original(unit)

    FSDPUnit.end_backward_at_callback = counting
    try:
        for _ in range(2):
            ended.append([])
            model(torch.randn(2, WIDTH))  # dropped: its graph is gone before the next forward
            model(torch.randn(2, WIDTH)).square().mean().backward()
    finally:
        FSDPUnit.end_backward_at_callback = original
    return ended


def test_a_dropped_forward_does_not_hold_units_gathered_to_the_end_of_backward():
    """Only the units with no input that requires grad (the root, the first block) wait for
    the callback; the others end at their inputs' gradients and reshard there. Counting the
    dropped forward kept every block gathered until the callback (the whole model at once)."""
    for ended in run_on_ranks(2, _units_ended_at_the_callback, timeout=60):
        assert ended == [["root", "blocks.0"]] * 2, ended
