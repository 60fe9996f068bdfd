"""The parts of torch's ZeroRedundancyOptimizer contract that go beyond a plain training step:
torch's Join context manager (uneven inputs), inner optimizers whose step takes no closure or
that add keys to their param groups, mixed dtypes, and the refusal of sparse parameters."""

import pytest
import torch
from torch.distributed.algorithms.join import Join

from shardwise import ZeroRedundancyOptimizer
from tests.harness import WORLD_SIZES, run_on_ranks

STEPS = 3


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 6),
                               torch.nn.Linear(6, 2))


def _grads(step: int, params) -> list[torch.Tensor]:
    """The (already averaged) gradients of a step: the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _join_uneven(ctx):
    """Rank r runs STEPS + r steps inside Join([optimizer]) (the optimizer is the first and only
    joinable, so its step() says "still training"); a rank that ran out takes part in the
    others' steps through the join hook, with no gradients set (zero_grad after each step), so
    the parameters it owns stay as they are. Reference: a plain Adam where the parameters of
    a rank that has run out get no gradient."""
    net, reference = _net(), _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.1)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    owner = opt.owners()
    steps_of = {p: STEPS + owner[p] for p in net.parameters()}
    with Join([opt]):
        for step in range(STEPS + ctx.rank):
            for p, g in zip(net.parameters(), _grads(step, list(net.parameters()))):
                p.grad = g
            opt.step()
            opt.zero_grad()
    for step in range(STEPS + ctx.world_size - 1):
        grads = _grads(step, list(reference.parameters()))
        for p, q, g in zip(net.parameters(), reference.parameters(), grads):
            q.grad = g if step < steps_of[p] else None
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.equal(p, q), "a parameter differs from the reference after Join"
    moved = [not torch.equal(p, q) for p, q in zip(net.parameters(), _net().parameters())]
    assert all(moved)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_join_with_uneven_inputs_equals_reference(world_size):
    run_on_ranks(world_size, _join_uneven)


def _join_properties(ctx):
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    assert opt.join_device == torch.device("cpu")
    assert opt.join_process_group is ctx.group
    # Join hands every joinable the same keyword arguments: they are accepted, not used
    assert opt.join_hook(anything=1) is not None


def test_join_device_and_group():
    run_on_ranks(2, _join_properties)


class _SGDWithoutClosure(torch.optim.SGD):
    def step(self):  # some optimizers' step takes no closure
        return super().step()


class _SGDWithNewKey(torch.optim.SGD):
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            group["steps_taken"] = group.get("steps_taken", 0) + 1
        return loss


def _inner_optimizers(ctx):
    for cls in (_SGDWithoutClosure, _SGDWithNewKey):
        net, reference = _net(), _net()
        opt = ZeroRedundancyOptimizer(net.parameters(), cls, lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(STEPS):
            for model in (net, reference):
                for p, g in zip(model.parameters(), _grads(step, list(model.parameters()))):
                    p.grad = g
            opt.step()
            ref_opt.step()
        for p, q in zip(net.parameters(), reference.parameters()):
            assert torch.equal(p, q), cls.__name__
        if cls is _SGDWithNewKey and opt.owned_params():
            # the key the inner optimizer added shows in ZeRO's own param_groups
            assert opt.param_groups[0]["steps_taken"] == STEPS


@pytest.mark.parametrize("world_size", (1, 2))
def test_inner_step_without_closure_and_added_keys(world_size):
    run_on_ranks(world_size, _inner_optimizers)


def _mixed_dtypes(ctx, bucket_view):
    """A float64 layer among float32 ones: each dtype is broadcast in its own buffers."""
    net, reference = _net(), _net()
    net[1].double()
    reference[1].double()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=0.05,
                                  parameters_as_bucket_view=bucket_view)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        for model in (net, reference):
            for p, g in zip(model.parameters(), _grads(step, list(model.parameters()))):
                p.grad = g
        opt.step()
        ref_opt.step()
    for p, q in zip(net.parameters(), reference.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bucket_view", (False, True))
def test_mixed_dtypes_equal_reference(world_size, bucket_view):
    run_on_ranks(world_size, _mixed_dtypes, bucket_view)


def _sparse_refused(ctx):
    dense = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"needs dense parameters; parameters \[1\] are "
                                         r"torch.sparse_coo"):
        ZeroRedundancyOptimizer([dense, torch.sparse_coo_tensor(size=(2, 3))],
                                torch.optim.SGD, lr=0.1)
    opt = ZeroRedundancyOptimizer([dense], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="needs dense parameters"):
        opt.add_param_group({"params": [torch.sparse_coo_tensor(size=(2, 3))]})
    assert len(opt.param_groups) == 1


def test_sparse_parameters_refused():
    run_on_ranks(1, _sparse_refused)
