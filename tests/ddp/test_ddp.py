"""Our DDP against one process training on the concatenated batch."""

import copy

import pytest
import torch
from torch import nn

from shardwise import DistributedDataParallel
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.harness import WORLD_SIZES, assert_rel_close, rank_slice, run_on_ranks, token_batch

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH = 8
RTOL = 1e-5


def _global_batch(step: int, micro: int = 1):
    return token_batch(step, micro, GLOBAL_BATCH, CFG.seq_len, CFG.vocab_size)


def _assert_params_close(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_rel_close(p, q, RTOL, name)


def _assert_grads_close(model, reference, step):
    # Adam is invariant to the gradient's scale, so equal parameters alone would not show that
    # gradients are averaged (not summed): compare the gradients themselves at every step.
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_rel_close(p.grad, q.grad, RTOL, f"step {step}: grad of {name}")


def _train_and_compare(ctx, steps, micro, bucket_cap_mb, as_view):
    torch.manual_seed(0)
    reference = GPT(CFG)
    torch.manual_seed(ctx.rank)  # replicas start different: the wrap must sync them
    model = DistributedDataParallel(GPT(CFG), bucket_cap_mb=bucket_cap_mb,
                                    gradient_as_bucket_view=as_view)
    _assert_params_close(model.module, reference)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = _global_batch(step, micro)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        for m in range(micro):
            if m < micro - 1:
                with model.no_sync():
                    (lm_loss(model(xr[m]), yr[m]) / micro).backward()
            else:
                (lm_loss(model(xr[m]), yr[m]) / micro).backward()
        ref_loss = sum(lm_loss(reference(x[m]), y[m]) / micro for m in range(micro))
        ref_loss.backward()
        _assert_grads_close(model.module, reference, step)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(ref_loss.item())
    _assert_params_close(model.module, reference)
    return losses


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_five_adam_steps_equal_single_process_on_concatenated_batch(world_size):
    # a 16 KiB cap splits the model into many buckets, so ordering across buckets is exercised
    run_on_ranks(world_size, _train_and_compare, 5, 1, 0.016, False)


@pytest.mark.parametrize("world_size", (2, 4))
def test_no_sync_accumulation_equals_one_big_batch(world_size):
    run_on_ranks(world_size, _train_and_compare, 3, 2, 25, True)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.used(x))


def _unused_parameter(ctx):
    torch.manual_seed(0)
    model = DistributedDataParallel(_WithUnused())
    x = torch.randn(3, 4)
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        raise AssertionError("a parameter without gradient was not reported")
    assert "unused.weight" in message and "unused.bias" in message
    assert "find_unused_parameters=True" in message

    torch.manual_seed(0)
    reference = _WithUnused()
    allowed = DistributedDataParallel(copy.deepcopy(reference), find_unused_parameters=True)
    xs = torch.randn(ctx.world_size, 3, 4, generator=torch.Generator().manual_seed(5))
    allowed(xs[ctx.rank]).sum().backward()
    reference(xs.reshape(-1, 4)).sum().div(ctx.world_size).backward()
    torch.testing.assert_close(allowed.module.used.weight.grad, reference.used.weight.grad)
    assert allowed.module.unused.weight.grad is None  # no rank used it: torch leaves None
    assert allowed.module.frozen.weight.grad is None


@pytest.mark.parametrize("world_size", (1, 2))
def test_parameter_without_gradient_is_named_unless_allowed(world_size):
    run_on_ranks(world_size, _unused_parameter)


def test_bad_module_is_rejected():
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        DistributedDataParallel(torch.zeros(3))


def _sync_flag(ctx):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 2))
    x = torch.full((2, 3), float(ctx.rank + 1))
    model.require_backward_grad_sync = False  # torch's flag behind no_sync, set directly
    model(x).sum().backward()
    local = model.module.weight.grad.clone()
    model.require_backward_grad_sync = True
    model.module.weight.grad = None
    model(x).sum().backward()
    return local, model.module.weight.grad


def test_require_backward_grad_sync_flag_acts_like_no_sync():
    (local0, synced0), (local1, synced1) = run_on_ranks(2, _sync_flag)
    assert not torch.equal(local0, local1)
    torch.testing.assert_close(synced0, (local0 + local1) / 2)
    torch.testing.assert_close(synced1, synced0)
