"""Our ``powerSGD_hook`` run by our DDP on its own buckets ([Note: PowerSGD inside DDP]),
against a one-process reference that computes PowerSGD from every rank's gradients, and against
the same hook called as a hook, on our DDP and on torch's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.ddp import hooks
from shardwise.ddp.powersgd import PowerSGDWork
from tests.harness import assert_rel_close, rank_slice, run_on_ranks

STEPS = 6
START = 2  # start_powerSGD_iter
BATCH = 16
LR = 0.1
# the reference sums the ranks' products in another order, and the in-DDP round computes the
# error with one fused multiply-add where the hook rounds the product first: float32 rounding
RTOL = 1e-5


class _Net(nn.Module):
    def __init__(self, with_spare: bool = False):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)
        # used on even steps only (for find_unused_parameters)
        self.spare = nn.Linear(32, 32) if with_spare else None

    def forward(self, x, use_spare=False):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(torch.tanh(self.spare(h)) if use_spare else h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 8, generator=gen)
    return x, torch.cos(x[:, :4]) + 0.1 * torch.randn(BATCH, 4, generator=gen)


def _hook_as_called(state, bucket):
    """The same hook under another name: DDP calls it as a hook."""
    return hooks.powerSGD_hook(state, bucket)


def _train(ctx, impl: str, called: bool, options: dict, join_from: int | None = None):
    """Train STEPS steps with PowerSGD; the final parameters, and how each bucket round went
    (``in_grads`` of the in-DDP rounds, empty when the hook was called)."""
    uses_spare = options.get("find_unused_parameters", False)
    torch.manual_seed(0)
    net = _Net(uses_spare)
    ddp_cls = shardwise.DistributedDataParallel if impl == "ours" else \
        torch.nn.parallel.DistributedDataParallel
    model = ddp_cls(net, **options)
    state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                start_powerSGD_iter=START)
    model.register_comm_hook(state, _hook_as_called if called else hooks.powerSGD_hook)
    rounds: list[bool] = []
    if impl == "ours" and model._powersgd is not None:
        launch = model._powersgd.launch

        def counted(*args) -> PowerSGDWork:
            work = launch(*args)
            rounds.append(work.in_grads)
            return work

        model._powersgd.launch = counted
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(k: int) -> None:
        x, y = _batch(k)
        opt.zero_grad()
        rx, ry = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        F.mse_loss(model(rx, uses_spare and k % 2 == 0), ry).backward()
        opt.step()

    last = STEPS if join_from is None else join_from
    for k in range(last):
        step(k)
    if join_from is not None:  # uneven inputs: rank r takes r more steps, inside join()
        with model.join():
            for k in range(last, STEPS + ctx.rank):
                step(k)
    return {n: p.detach().clone() for n, p in net.named_parameters()}, rounds


def _compressible(shape: torch.Size) -> bool:
    n, m = shape[0], math.prod(shape[1:])
    return len(shape) >= 2 and (n + m) * 2 < n * m


def _reference(world_size: int, uses_spare: bool) -> dict[str, torch.Tensor]:
    """PowerSGD in one process: every rank's gradient on its slice, rank-1 approximation of
    their sum with error feedback per rank, warm start, the hook's seeded first Q's (one bucket,
    matrices in reverse registration order)."""
    torch.manual_seed(0)
    net = _Net(uses_spare)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    errors: dict[tuple[int, str], torch.Tensor] = {}
    qs: dict[str, torch.Tensor] = {}
    for k in range(STEPS):
        x, y = _batch(k)
        grads = []
        for r in range(world_size):
            net.zero_grad()
            out = net(rank_slice(x, r, world_size), uses_spare and k % 2 == 0)
            F.mse_loss(out, rank_slice(y, r, world_size)).backward()
            grads.append({n: p.grad.clone() for n, p in net.named_parameters()
                          if p.grad is not None})
        for name, p in reversed(list(net.named_parameters())):
            used = any(name in g for g in grads)  # DDP leaves .grad alone where no rank did
            local = [g.get(name, torch.zeros_like(p)) for g in grads]
            ms = [g + errors.get((r, name), 0) for r, g in enumerate(local)]
            if k < START:
                p.grad = sum(local) / world_size if used else None
                continue
            if not _compressible(p.shape):
                mean = sum(ms) / world_size
            else:
                mats = [m.reshape(p.shape[0], -1) for m in ms]
                if name not in qs:
                    qs[name] = torch.randn(mats[0].shape[1], 1, generator=gen)
                basis, _ = torch.linalg.qr(sum(m @ qs[name] for m in mats))
                qs[name] = sum(m.t() @ basis for m in mats) / world_size
                mean = (basis @ qs[name].t()).view_as(p)
            for r, m in enumerate(ms):
                errors[(r, name)] = m - mean
            p.grad = mean if used else None
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


OPTIONS = {
    "into .grad": {},
    "several buckets": {"bucket_cap_mb": 0.002},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def _check_all(ctx) -> dict:
    """Every option, in DDP and called as a hook; torch's DDP calling the hook."""
    out = {}
    for label, options in OPTIONS.items():
        out[label] = (_train(ctx, "ours", False, options), _train(ctx, "ours", True, options))
    out["torch"] = _train(ctx, "torch", False, {})
    return out


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        assert_rel_close(actual[name], value, RTOL, f"{what}: {name}")


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_powersgd_in_ddp_is_the_hook_and_the_reference(world_size):
    results = run_on_ranks(world_size, _check_all)
    reference = {uses: _reference(world_size, uses) for uses in (False, True)}
    for rank, result in enumerate(results):
        for label, options in OPTIONS.items():
            (fused, rounds), (called, hook_rounds) = result[label]
            expected = reference["find_unused_parameters" in options]
            _assert_close(fused, expected, f"rank {rank}, in DDP, {label}")
            _assert_close(called, expected, f"rank {rank}, hook called, {label}")
            assert rounds, f"{label}: DDP called the hook instead of running it"
            assert not hook_rounds, f"{label}: a hook under another name was not called"
            n_buckets = len(rounds) // STEPS
            compressed = rounds[START * n_buckets:]
            assert all(compressed) == (label in ("into .grad", "several buckets")), (
                f"{label}: the mean should land in .grad exactly when every parameter has a "
                f"gradient of its own there")
            assert not any(rounds[: START * n_buckets]), "plain all-reduce steps land in .grad"
        theirs, _ = result["torch"]
        _assert_close(theirs, reference[False], f"rank {rank}, torch's DDP calling the hook")


def _join_mix(ctx) -> dict:
    return {called: _train(ctx, "ours", called, {}, join_from=3)[0] for called in (False, True)}


@pytest.mark.parametrize("world_size", (2, 4))
def test_powersgd_in_ddp_mixes_with_the_hook_under_join(world_size):
    """Three steps run in DDP, then uneven inputs under join(): the hook runs on every rank
    (a joined rank's all-zero buckets among them) with the state the in-DDP steps left."""
    results = run_on_ranks(world_size, _join_mix)
    for rank, result in enumerate(results):
        _assert_close(result[False], result[True], f"rank {rank}")
        if rank:
            _assert_close(result[False], results[0][False], f"rank {rank} against rank 0")
