"""ZeroDataParallel (stage 2) against one process training on the whole batch."""

import math
import os

import pytest
import torch

from shardwise import ZeroDataParallel, ZeroRedundancyOptimizer
from shardwise.dp.shm_reduce import DISABLE_VAR
from shardwise.memory import state_bytes
from shardwise.zero import stage2
from tests.harness import WORLD_SIZES, assert_rel_close, rank_slice, run_on_ranks
from tests.harness.ops import OpCounts
from tests.zero.common import (
    RTOL,
    assert_params_equal,
    global_batch,
    loss_fn,
    make_net,
    optimizer_kwargs,
    param_groups,
    schedule,
)

BUCKET_MB = 0.001  # ~1 KiB buckets: many buckets, several per owner


def _backward(model, x, y, ctx, micro):
    xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
    for m in range(micro):
        loss = loss_fn(model(xr[m]), yr[m]) / micro
        if m < micro - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()


def _check_grads(net, reference, model, step):
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        if not p.requires_grad:
            assert p.grad is None and q.grad is None
        elif q.grad is None:  # no rank used it
            assert p.grad is None, f"step {step}: {name} has a gradient; no rank used it"
        elif any(p is o for o in model.owned_parameters()):
            assert_rel_close(p.grad, q.grad, RTOL, f"step {step}: grad of {name}")
        else:
            assert p.grad is None, f"step {step}: {name} is not owned but kept its gradient"


def _check_and_step(net, reference, model, opt, ref_opt, step):
    """Gradients against the reference's, then both optimizers step; parameters equal."""
    _check_grads(net, reference, model, step)
    opt.step()
    opt.zero_grad()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_params_equal(net, reference, f"step {step}")


def _hook(name: str | None):
    """``"torch.fp16_compress_hook"`` or ``"ours.allreduce_hook"``... -> the hook."""
    if name is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from shardwise.ddp import hooks
    lib, hook = name.split(".")
    return getattr(default_hooks if lib == "torch" else hooks, hook)


def _train(ctx, opt_name, steps, micro, clip, hook=None, shm=True):
    cls, kwargs = optimizer_kwargs(opt_name)
    reference = make_net()
    ref_opt = cls(param_groups(reference), **kwargs)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    net = make_net(seed=ctx.rank)  # replicas start different: the wrap syncs them
    opt = ZeroRedundancyOptimizer(param_groups(net), optimizer_class=cls, **kwargs)
    os.environ[DISABLE_VAR] = "0" if shm else "1"
    try:
        model = ZeroDataParallel(net, opt, bucket_cap_mb=BUCKET_MB)
    finally:
        del os.environ[DISABLE_VAR]
    # the reduce-scatter goes through shared memory on one host unless turned off
    assert (model._scatter.shm is not None) == (shm and ctx.world_size > 1)
    owners = [{model._owner[p] for p in b.params} for b in model.reducer.buckets]
    if ctx.world_size == 4:  # (at 2 ranks one rank owns every parameter but the largest)
        assert any(len(o) > 1 for o in owners), "buckets hold several owners' parts"
    if hook is not None:
        model.register_comm_hook(None, _hook(hook))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(steps):
        x, y = global_batch(step, micro)
        _backward(model, x, y, ctx, micro)
        sum(loss_fn(reference(x[m]), y[m]) / micro for m in range(micro)).backward()
        if clip:
            norm = model.clip_grad_norm_(clip, norm_type=2.0)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            assert_rel_close(norm, ref_norm, RTOL, f"step {step}: total norm")
        _check_grads(net, reference, model, step)
        opt.step()
        sched.step()
        opt.zero_grad()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        assert_params_equal(net, reference, f"{opt_name} step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("opt_name", ("adamw", "sgd"))
def test_ten_steps_equal_single_process(world_size, opt_name):
    run_on_ranks(world_size, _train, opt_name, 10, 1, None)


@pytest.mark.parametrize("world_size", (2, 4))
def test_reduce_per_owner_without_shared_memory_equals_single_process(world_size):
    run_on_ranks(world_size, _train, "adamw", 3, 1, None, None, False)


@pytest.mark.parametrize("hook", ("torch.allreduce_hook", "ours.allreduce_hook"))
@pytest.mark.parametrize("world_size", (2, 4))
def test_allreduce_comm_hook_equals_single_process(world_size, hook):
    run_on_ranks(world_size, _train, "adamw", 10, 2, None, hook)


def _fp16_grads(ctx, hook):
    net = make_net()
    opt = ZeroRedundancyOptimizer(param_groups(net), optimizer_class=torch.optim.SGD, lr=0.1)
    model = ZeroDataParallel(net, opt, bucket_cap_mb=BUCKET_MB)
    model.register_comm_hook(None, _hook(hook))
    x, y = global_batch(0, 1)
    _backward(model, x, y, ctx, 1)
    reference = make_net()
    loss_fn(reference(x[0]), y[0]).backward()
    owned = {id(p) for p in model.owned_parameters()}
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        if not p.requires_grad:
            continue
        if id(p) in owned:  # fp16 keeps 11 significant bits: one rounding of each part and sum
            assert_rel_close(p.grad, q.grad, 2e-3, f"{hook}: gradient of {name}")
        else:
            assert p.grad is None, f"{name} is not owned but kept its gradient"


@pytest.mark.parametrize("hook", ("torch.fp16_compress_hook", "ours.fp16_compress_hook"))
@pytest.mark.parametrize("world_size", (2, 4))
def test_fp16_comm_hook_gives_owned_gradients_within_tolerance(world_size, hook):
    run_on_ranks(world_size, _fp16_grads, hook)


@pytest.mark.parametrize("world_size", (2, 4))
def test_no_sync_accumulation_with_clipping(world_size):
    # clip at 0.05, well under the gradients' norm, so clipping changes every step
    run_on_ranks(world_size, _train, "adamw", 4, 3, 0.05)


def _reused_parts(ctx, zero_grad_to_none: bool):
    reference = make_net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    net = make_net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    model = ZeroDataParallel(net, opt, bucket_cap_mb=BUCKET_MB)
    pointers, held = [], []
    for step in range(3):
        x, y = global_batch(step)
        _backward(model, x, y, ctx, 1)
        loss_fn(reference(x[0]), y[0]).backward()
        _check_grads(net, reference, model, step)
        grads = {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
        held.append(grads)  # kept alive: a fresh allocation could not land at the same address
        pointers.append({name: g.data_ptr() for name, g in grads.items()})
        opt.step()
        opt.zero_grad(set_to_none=zero_grad_to_none)
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_equal(net, reference, f"step {step}")
    return pointers


@pytest.mark.parametrize("to_none", (True, False))
@pytest.mark.parametrize("world_size", (2, 4))
def test_owned_gradients_reuse_one_buffer_per_bucket_across_steps(world_size, to_none):
    # each bucket's owned part is allocated once: the gradients of steps 2 and 3 live at the
    # addresses of step 1's, and training still equals the single process
    for pointers in run_on_ranks(world_size, _reused_parts, to_none):
        assert pointers[0], "this rank owns gradients"
        assert pointers[0] == pointers[1] == pointers[2]


def _inf_norm(ctx):
    reference = make_net()
    net = make_net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    model = ZeroDataParallel(net, opt, bucket_cap_mb=BUCKET_MB)
    x, y = global_batch(0)
    _backward(model, x, y, ctx, 1)
    loss_fn(reference(x[0]), y[0]).backward()
    norm = model.clip_grad_norm_(1e-3, norm_type=math.inf)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3, norm_type=math.inf)
    assert_rel_close(norm, ref_norm, RTOL, "inf norm")
    _check_grads(net, reference, model, 0)


@pytest.mark.parametrize("world_size", (1, 2))
def test_clip_by_inf_norm(world_size):
    run_on_ranks(world_size, _inf_norm)


def _deep_net():
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
    return torch.nn.Sequential(torch.nn.Linear(6, 32), *layers, torch.nn.Linear(32, 3))


def _grad_bytes(ctx):
    net = _deep_net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    model = ZeroDataParallel(net, opt, bucket_cap_mb=0.004)  # about one 32x32 layer per bucket
    live = []

    def record(_):  # during backward: gradients still set plus every allocated bucket buffer
        buffers = [b.buffer for b in model.reducer.buckets if b.buffer is not None]
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        live.append(state_bytes(grads + buffers).params)

    for p in net.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(record)
    x, y = global_batch(0)
    _backward(model, x, y, ctx, 1)
    after = state_bytes(net).grads
    opt.step()  # and the step works on the sharded gradients
    total = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    bucket = max(b.numel * p.element_size() for b in model.reducer.buckets for p in b.params)
    return after, total, bucket, max(live)


@pytest.mark.parametrize("world_size", (2, 4))
def test_gradient_bytes_after_backward_are_sharded(world_size):
    results = run_on_ranks(world_size, _grad_bytes)
    total, bucket = results[0][1], results[0][2]
    after = [r[0] for r in results]
    assert sum(after) == total  # every gradient kept once, on its owner
    assert max(after) <= total / world_size + bucket, (after, total, bucket)
    # during backward a rank never holds a full set of gradients (buffers included)
    assert max(r[3] for r in results) < 0.8 * total, ([r[3] for r in results], total)


def _errors(ctx):
    net = make_net()
    with pytest.raises(TypeError, match="needs the shardwise.ZeroRedundancyOptimizer"):
        ZeroDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="stage"):  # stage 2 only: no stage to choose
        ZeroDataParallel(net, opt, stage=1)
    with pytest.raises(TypeError, match="positional"):  # options are keywords
        ZeroDataParallel(net, opt, 25)
    partial = ZeroRedundancyOptimizer(net.inp.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"not in the optimizer.*mid\.weight"):
        ZeroDataParallel(net, partial)
    model = ZeroDataParallel(net, opt)
    x, y = global_batch(0)
    _backward(model, x, y, ctx, 1)
    opt.step()
    with pytest.raises(RuntimeError, match="Call optimizer.zero_grad"):
        model(x[0])  # forgot zero_grad: the reduced gradients would be reduced again
    opt.zero_grad()
    model(x[0])


def test_bad_input_errors():
    run_on_ranks(1, _errors)


def _forward_checks(ctx, zero_grad_to_none: bool):
    net = _deep_net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    model = ZeroDataParallel(net, opt, bucket_cap_mb=1, broadcast_buffers=False)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=zero_grad_to_none)
    with OpCounts() as ops:
        model(x)
    return ops.counts, len(model.owned_parameters())


@pytest.mark.parametrize("to_none", (False, True))
def test_cleared_gradient_check_costs_one_sync_not_one_per_parameter(to_none):
    # issue 16 item 5: the check before forward used to run .any() and a sync per parameter
    for counts, owned in run_on_ranks(2, _forward_checks, to_none):
        assert owned >= 8, "the test needs many owned parameters"
        syncs = counts.get("aten._local_scalar_dense", 0)
        assert syncs == (0 if to_none else 1), counts
        assert counts.get("aten.any", 0) <= 2, counts  # one per owned bucket (1 MiB cap)


class _Reversed(torch.nn.Module):
    """Layers used in the reverse of their registration order: the gradients of the first
    buckets (the last registered parameters) arrive last in backward, after later buckets have
    started filling ([Note: stage 2 shared-memory ring])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _out_of_order(ctx, ring):
    reference = _Reversed()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    net = _Reversed()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    default, stage2.SHM_RING = stage2.SHM_RING, ring
    try:
        model = ZeroDataParallel(net, opt, bucket_cap_mb=1e-4)  # one parameter per bucket
    finally:
        stage2.SHM_RING = default
    assert len(model.reducer.buckets) == 12
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=gen)
        model(rank_slice(x, ctx.rank, ctx.world_size)).pow(2).sum().backward()
        (reference(x).pow(2).sum() / ctx.world_size).backward()  # the average of rank sums
        _check_and_step(net, reference, model, opt, ref_opt, step)
    ring = model._scatter.ring
    return None if ring is None else (ring.capacity, ring.private_fills)


@pytest.mark.parametrize("ring", (100, stage2.SHM_RING, 1))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradients_out_of_bucket_order_equal_single_process(world_size, ring):
    # ring 100: every bucket has a region of its own; 3 (the default) and 1: the ring holds 3
    # or 1 largest buckets, so regions wrap and overlap: the bucket filled first in backward
    # must not take bytes a bucket launched before it still needs
    results = run_on_ranks(world_size, _out_of_order, ring)
    if world_size == 1:
        assert results == [None], "one rank: no shared memory"
        return
    for capacity, private in results:
        # 6 weights of 64 elements and 6 biases of 8, each padded to 16 (64 bytes)
        assert capacity == min(6 * (64 + 16), ring * 64), capacity
        if ring == 1:  # the first bucket of backward is refused its region in every step
            assert private >= 3, private


class _PartlyUsed(torch.nn.Module):
    """Layers in a row, a branch that the step's ranks run, and a pooler never run."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.branch, self.pooler = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, branch: bool):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.branch(x) if branch else x


def _unused(ctx, shm: bool):
    torch.manual_seed(0)
    reference, net = _PartlyUsed(), _PartlyUsed()
    net.load_state_dict(reference.state_dict())
    kwargs = {"lr": 0.1, "weight_decay": 0.5}
    ref_opt = torch.optim.AdamW(reference.parameters(), **kwargs)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)
    os.environ[DISABLE_VAR] = "0" if shm else "1"
    try:
        model = ZeroDataParallel(net, opt, bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
    finally:
        del os.environ[DISABLE_VAR]
    gen = torch.Generator().manual_seed(5)
    for step in range(3):  # the branch runs on no rank, on the last rank only, on every rank
        on = [set(), {ctx.world_size - 1}, set(range(ctx.world_size))][step]
        xs = torch.randn(ctx.world_size, 2, 8, generator=gen)
        for r, x in enumerate(xs):
            (reference(x, r in on).square().mean() / ctx.world_size).backward()
        model(xs[ctx.rank], ctx.rank in on).square().mean().backward()
        _check_and_step(net, reference, model, opt, ref_opt, step)


@pytest.mark.parametrize("world_size,shm", [(1, True), (2, True), (4, True), (2, False)])
def test_parameters_no_rank_used_keep_grad_none_and_adamw_leaves_them(world_size, shm):
    """With find_unused_parameters=True a parameter no rank used keeps ``grad is None``, as
    with DDP and one process; its owner got a zero gradient before, and AdamW decayed it."""
    run_on_ranks(world_size, _unused, shm)
