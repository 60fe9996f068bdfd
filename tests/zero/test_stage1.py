"""ZeroRedundancyOptimizer (stage 1) against one process training on the whole batch."""

import pytest
import torch

from shardwise import DistributedDataParallel, ZeroRedundancyOptimizer
from shardwise.memory import state_bytes
from tests.harness import WORLD_SIZES, assert_rel_close, rank_slice, run_on_ranks
from tests.harness.ops import OpCounts
from tests.zero.common import (
    assert_params_equal,
    global_batch,
    loss_fn,
    make_net,
    optimizer_kwargs,
    param_groups,
    schedule,
)


def _train(ctx, opt_name, steps, bucket_view):
    cls, kwargs = optimizer_kwargs(opt_name)
    reference = make_net()
    ref_opt = cls(param_groups(reference), **kwargs)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    net = make_net(seed=ctx.rank)  # replicas start different: DDP's wrap syncs them
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(param_groups(net), optimizer_class=cls,
                                  parameters_as_bucket_view=bucket_view, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(steps):
        x, y = global_batch(step)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss_fn(model(xr[0]), yr[0]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        loss_fn(reference(x[0]), y[0]).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        assert_params_equal(net, reference, f"{opt_name} step {step}")
    assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"]
    assert torch.equal(net.frozen.weight, reference.frozen.weight)
    return [p.detach().clone() for p in net.parameters()], state_bytes(net, opt).optimizer


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("opt_name", ("adamw", "sgd"))
def test_ten_steps_equal_single_process(world_size, opt_name):
    results = run_on_ranks(world_size, _train, opt_name, 10, False)
    for params, _ in results[1:]:  # every rank holds the same parameters
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))


@pytest.mark.parametrize("opt_name", ("adamw", "adam", "adagrad", "sgd"))
def test_parameters_as_bucket_view(opt_name):
    run_on_ranks(2, _train, opt_name, 4, True)


def _state_shares(ctx):
    reference = make_net()
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    loss_fn(reference(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    ref_opt.step()
    total = state_bytes(reference, ref_opt).optimizer
    largest = max(p.numel() * p.element_size() for p in reference.parameters())
    _, mine = _train(ctx, "adamw", 2, False)
    return mine, total, largest


@pytest.mark.parametrize("world_size", (2, 4))
def test_optimizer_state_bytes_are_sharded(world_size):
    results = run_on_ranks(world_size, _state_shares)
    total, largest = results[0][1], results[0][2]
    largest_state = 2 * largest + 4  # AdamW: exp_avg, exp_avg_sq and a 4-byte step
    per_rank = [mine for mine, _, _ in results]
    assert sum(per_rank) == total
    assert max(per_rank) <= total / world_size + largest_state, (per_rank, total)


def _add_group(ctx):
    reference = make_net()
    groups = param_groups(reference)
    ref_opt = torch.optim.SGD(groups[:1], lr=1e-2, momentum=0.9)
    net = make_net()
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(param_groups(net)[:1], torch.optim.SGD, lr=1e-2, momentum=0.9)
    for step in range(4):
        if step == 2:
            ref_opt.add_param_group({"params": groups[1]["params"], "lr": 0.05})
            opt.add_param_group({"params": list(net.head.parameters()), "lr": 0.05})
        x, y = global_batch(step)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss_fn(model(xr[0]), yr[0]).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(reference(x[0]), y[0]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_equal(net, reference, "after add_param_group")
    assert opt.param_groups[1]["momentum"] == 0.9  # the class default filled in


def test_add_param_group_later():
    run_on_ranks(2, _add_group)


def _closure_step(ctx):
    net = make_net()
    reference = make_net()
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    x, y = global_batch(0)
    xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(xr[0]), yr[0])
        loss.backward()
        return loss

    loss = opt.step(closure)
    ref_loss = loss_fn(reference(x[0]), y[0])
    ref_loss.backward()
    ref_opt.step()
    assert_params_equal(net, reference, "closure step")
    return loss.item()


def test_step_with_closure_returns_the_loss():
    losses = run_on_ranks(2, _closure_step)
    assert all(isinstance(v, float) for v in losses)


class _BigNet(torch.nn.Module):
    """Two weights of at least 1 MiB (broadcast in place) and small ones (coalesced)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 600)
        self.b = torch.nn.Linear(600, 512)
        self.c = torch.nn.Linear(512, 512)
        self.d = torch.nn.Linear(512, 3)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _big_train(ctx):
    torch.manual_seed(0)
    reference = _BigNet()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    net = _BigNet()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    counts = []
    for step in range(3):
        x, y = global_batch(step)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss_fn(net(xr[0]), yr[0]).backward()
        for p in net.parameters():  # average by hand: only the optimizer is under test
            torch.distributed.all_reduce(p.grad, group=ctx.group)
            p.grad /= ctx.world_size
        with OpCounts() as ops:
            opt.step()
        counts.append(ops.counts)
        opt.zero_grad()
        loss_fn(reference(x[0]), y[0]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (name, p), q in zip(net.named_parameters(), reference.parameters()):
            assert_rel_close(p, q, 1e-6, f"step {step}: {name}")
    parts = opt._parts()
    mine_coalesced = sum(1 for src, ts in parts if src == ctx.rank and len(ts) > 1)
    return counts, len(parts), mine_coalesced, sum(1 for _, ts in parts if len(ts) == 1)


@pytest.mark.parametrize("world_size", (2, 4))
def test_step_broadcasts_each_part_once_big_parameters_in_place(world_size):
    for rank, (counts, n_parts, mine_coalesced, alone) in enumerate(
            run_on_ranks(world_size, _big_train)):
        assert alone >= 2, "the two weights of >= 1 MiB are parts of their own"
        for step in counts:  # per step: one broadcast per part, no more; a flattening copy
            assert step.get("c10d.broadcast_", 0) == n_parts, (rank, step)  # per own chunk
            assert step.get("aten.cat", 0) == mine_coalesced, (rank, step)
