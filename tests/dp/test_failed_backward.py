"""A backward that raised part-way and was caught must not leak into the steps after it, for the
wrappers built on the gradient bucketer (DDP, ZeRO stage 2): ``GradBucketer.
end_abandoned_backward``. Without it the next backward found the failed pass's buckets still
filling and refused ("received a second gradient"); torch's DDP refuses too ("Expected to have
finished reduction in the prior iteration"). Every completed step is compared with a
one-process reference that skips the failed step."""

import os
import warnings

import pytest
import torch
from torch import nn

from shardwise import DistributedDataParallel, ZeroDataParallel, ZeroRedundancyOptimizer
from shardwise.dp.shm_reduce import DISABLE_VAR
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks
from tests.harness.failures import Injected, raise_in_backward

RTOL = 1e-5


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _wrap(kind: str, net: nn.Module):
    if kind == "ddp":
        return DistributedDataParallel(net, bucket_cap_mb=0.001), list(net.parameters())
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    model = ZeroDataParallel(net, opt, bucket_cap_mb=0.001)
    return model, list(model.owned_parameters())


def _steps(ctx, kind: str, shm: bool):
    reference, net = _net(), _net()
    os.environ[DISABLE_VAR] = "0" if shm else "1"
    try:
        model, checked = _wrap(kind, net)
    finally:
        del os.environ[DISABLE_VAR]
    names = {id(p): n for n, p in net.named_parameters()}
    ref = dict(reference.named_parameters())
    gen = torch.Generator().manual_seed(5)
    said = []
    for step in range(4):
        xs = torch.randn(ctx.world_size, 3, 16, generator=gen)
        if step == 1:  # every rank raises once the middle layer's output has its gradient
            hook = net[2].register_forward_hook(raise_in_backward)
            with pytest.raises(Injected):
                model(xs[ctx.rank]).square().mean().backward()
            hook.remove()
            net.zero_grad(set_to_none=True)
            continue
        reference.zero_grad()
        for x in xs:
            (reference(x).square().mean() / ctx.world_size).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(xs[ctx.rank]).square().mean().backward()
        said += [str(w.message) for w in caught if "raised" in str(w.message)]
        for p in checked:
            assert_rel_close(p.grad, ref[names[id(p)]].grad, RTOL, f"step {step}")
        net.zero_grad(set_to_none=True)
    return said


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["ddp", "zero2"])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_steps_after_a_backward_that_raised_match_the_reference(world_size, kind, shm):
    if world_size == 1 and not shm:
        pytest.skip("one rank communicates through neither")
    said = run_on_ranks(world_size, _steps, kind, shm, timeout=60)
    assert all(len(s) == 1 and "previous backward" in s[0] for s in said), said
