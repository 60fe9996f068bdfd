"""``register_comm_hook`` with torch's own hooks from ``ddp_comm_hooks.default_hooks``, on torch's
DDP and ours, against one process training on the concatenated batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardwise import DistributedDataParallel
from shardwise.ddp import hooks as our_hooks
from shardwise.dp.shm_reduce import DISABLE_VAR
from tests.compat.common import assert_states_close, ddp_class, state_of
from tests.harness import WORLD_SIZES, rank_slice, reference_train, run_on_ranks

STEPS = 3
GLOBAL_BATCH = 8
# fp16 keeps 11 significant bits, bf16 8: one rounding of each gradient and of the sum
TOLERANCE = {"allreduce_hook": 1e-6, "fp16_compress_hook": 2e-3, "bf16_compress_hook": 1.6e-2}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _batch(step: int):
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def _train(ctx, impl: str, hook_name: str | None, lib: str = "torch"):
    """Records every step's gradients; a 1 KiB bucket cap gives several buckets. ``lib``:
    torch's hooks or ours (shardwise.ddp.hooks); no hook when ``hook_name`` is None."""
    torch.manual_seed(0)
    model = ddp_class(impl)(_Net(), bucket_cap_mb=0.001)
    if hook_name is not None:
        model.register_comm_hook(None, getattr(default_hooks if lib == "torch" else our_hooks,
                                               hook_name))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    grads = []
    for step in range(STEPS):
        x, y = _batch(step)
        rx, ry = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        opt.zero_grad()
        F.mse_loss(model(rx), ry).backward()
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        opt.step()
    return grads, state_of(model.module)


def _reference():
    run = reference_train(_Net, _loss, lambda m: torch.optim.SGD(m.parameters(), lr=0.2),
                          STEPS, keep_grads=True)
    return run.grads, run.state()


def _loss(model, step):
    x, y = _batch(step)
    return F.mse_loss(model(x), y)


def _check(result, expected, rtol: float, what: str) -> None:
    grads, state = result
    for step, (got, want) in enumerate(zip(grads, expected[0])):
        assert_states_close(got, want, rtol, f"{what}, step {step} gradients")
    assert_states_close(state, expected[1], rtol, f"{what}, final parameters")


@pytest.mark.parametrize("hook", ("allreduce_hook", "fp16_compress_hook"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_default_hooks_match_reference_and_torch_ddp(world_size, hook):
    ours = run_on_ranks(world_size, _train, "ours", hook)
    theirs = run_on_ranks(world_size, _train, "torch", hook)
    reference = _reference()
    for rank in range(world_size):
        _check(ours[rank], reference, TOLERANCE[hook], f"{hook}, rank {rank} vs reference")
        _check(ours[rank], theirs[rank], TOLERANCE[hook], f"{hook}, rank {rank} vs torch")


@pytest.mark.parametrize("world_size", (2, 4))
def test_bf16_hook_matches_reference(world_size):
    # torch's DDP refuses bf16_compress_hook without CUDA and NCCL; gloo reduces bfloat16 on
    # CPU, so ours runs it (compared with the reference only)
    ours = run_on_ranks(world_size, _train, "ours", "bf16_compress_hook")
    reference = _reference()
    for rank in range(world_size):
        _check(ours[rank], reference, TOLERANCE["bf16_compress_hook"], f"rank {rank}")


@pytest.mark.parametrize("hook", tuple(TOLERANCE))
@pytest.mark.parametrize("world_size", (2, 4))
def test_our_hooks_match_reference_on_both_ddps(world_size, hook):
    reference = _reference()
    for impl in ("ours", "torch") if hook != "bf16_compress_hook" else ("ours",):
        result = run_on_ranks(world_size, _train, impl, hook, "ours")
        for rank in range(world_size):
            _check(result[rank], reference, TOLERANCE[hook],
                   f"shardwise.ddp.hooks.{hook} on {impl}'s DDP, rank {rank}")


def _same_host_vs_gloo(ctx, hook_name: str, lib: str):
    """The compression hook's training on the shared-memory path ([Note: compression on one
    host]), with the hook itself called over gloo, and without a hook; whether the first path
    was taken."""
    results = []
    for disabled, hook in (("0", hook_name), ("1", hook_name), ("0", None)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(DISABLE_VAR, disabled)
            results.append(_train(ctx, "ours", hook, lib))
    torch.manual_seed(0)
    probe = DistributedDataParallel(_Net(), bucket_cap_mb=0.001)
    probe.register_comm_hook(None, getattr(default_hooks if lib == "torch" else our_hooks,
                                           hook_name))
    return results, probe._compressed is not None and probe._shm is not None


@pytest.mark.parametrize("lib", ("torch", "ours"))
@pytest.mark.parametrize("hook", ("fp16_compress_hook", "bf16_compress_hook"))
@pytest.mark.parametrize("world_size", (2, 4))
def test_compression_on_one_host_is_the_mean_rounded_once(world_size, hook, lib):
    out = run_on_ranks(world_size, _same_host_vs_gloo, hook, lib)
    half = torch.float16 if hook.startswith("fp16") else torch.bfloat16
    ulp = torch.finfo(half).eps
    for rank in range(world_size):
        (shm_grads, shm_state), (gloo_grads, _), (plain_grads, _) = out[rank][0]
        assert out[rank][1], "the shared-memory path was not taken"
        # first step (same parameters): the float32 mean without a hook, rounded once
        for name, grad in shm_grads[0].items():
            assert torch.equal(grad, plain_grads[0][name].to(half).float()), name
        # the hook over gloo rounds more often: a unit or two in the last place
        for step, (a, b) in enumerate(zip(shm_grads, gloo_grads)):
            for name in a:
                scale = float(torch.maximum(a[name].abs().max(), b[name].abs().max()))
                assert float((a[name] - b[name]).abs().max()) <= 4 * ulp * scale, (step, name)
        _check((shm_grads, shm_state), _reference(), TOLERANCE[hook], f"{hook} on shm")


def _bucket_view_hook(state, bucket):
    """Records what the bucket interface shows, then reduces like allreduce_hook."""
    state.append((bucket.index(), bucket.is_last(), [p.shape for p in bucket.parameters()],
                  [g.shape for g in bucket.gradients()], bucket.buffer().numel()))
    return default_hooks.allreduce_hook(None, bucket)


def _bucket_interface(ctx):
    torch.manual_seed(0)
    model = DistributedDataParallel(_Net(), bucket_cap_mb=0.001)
    seen: list = []
    model.register_comm_hook(seen, _bucket_view_hook)
    F.mse_loss(model(torch.randn(2, 6)), torch.zeros(2, 3)).backward()
    return seen


def test_hook_sees_torch_grad_bucket_interface():
    seen = run_on_ranks(2, _bucket_interface)[0]
    assert [s[0] for s in seen] == list(range(len(seen))) and len(seen) > 1
    assert [s[1] for s in seen] == [False] * (len(seen) - 1) + [True]
    for _, _, param_shapes, grad_shapes, numel in seen:
        assert param_shapes == grad_shapes
        assert numel == sum(torch.Size(s).numel() for s in param_shapes)


def _not_a_future(state, bucket):
    return bucket.buffer()


def _wrong_shape(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer()[:1])
    return fut


def _set_buffer_hook(state, bucket):
    """Replaces the buffer with a doubled copy and returns it (a future of the new buffer)."""
    doubled = bucket.buffer() * 2
    bucket.set_buffer(doubled)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _errors(ctx):
    torch.manual_seed(0)
    x, y = torch.randn(2, 6), torch.zeros(2, 3)
    out = {}
    model = DistributedDataParallel(_Net())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as exc:
        out["twice"] = str(exc)
    for name, hook in (("future", _not_a_future), ("shape", _wrong_shape)):
        model = DistributedDataParallel(_Net())
        model.register_comm_hook(None, hook)
        try:
            F.mse_loss(model(x), y).backward()
        except (TypeError, RuntimeError) as exc:
            out[name] = str(exc)
        # the failed reduction is forgotten: the same model trains on with a good hook
        model._comm_hooks.hook = None
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        F.mse_loss(model(x), y).backward()
    for bad in (3, lambda bucket: None):
        try:
            DistributedDataParallel(_Net()).register_comm_hook(None, bad)
        except TypeError as exc:
            out.setdefault("bad", []).append(str(exc))
    model = DistributedDataParallel(_Net())
    model.register_comm_hook(None, _set_buffer_hook)
    F.mse_loss(model(x), y).backward()
    local = _Net()
    local.load_state_dict(model.module.state_dict())
    F.mse_loss(local(x), y).backward()
    out["set_buffer"] = [torch.equal(p.grad, 2 * q.grad)
                         for p, q in zip(model.module.parameters(), local.parameters())]
    return out


def test_hook_errors_are_clear_and_set_buffer_is_honoured():
    out = run_on_ranks(1, _errors)[0]
    assert "only be called once" in out["twice"]
    assert "must return a torch.futures.Future" in out["future"] and "Tensor" in out["future"]
    assert "shape (435,)" in out["shape"] and "shape (1,)" in out["shape"]
    assert "must be callable" in out["bad"][0] and "two arguments" in out["bad"][1]
    assert all(out["set_buffer"])
