"""FullyShardedDataParallel's constructor takes torch FSDP1's arguments strictly: unknown keywords
are a TypeError, unsupported values a clear error, accepted-but-unhonoured ones warn once, and
the honoured ones (torch's MixedPrecision / CPUOffload / ShardingStrategy objects,
ignored_modules, param_init_fn, device_mesh) do what torch's do."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.tensor import DTensor

from shardwise import FullyShardedDataParallel as FSDP
from shardwise import MixedPrecision
from shardwise.distributed import init_device_mesh
from shardwise.fsdp import transformer_auto_wrap_policy
from shardwise.fsdp.fsdp1 import args as fsdp1_args
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.models.gpt import Block
from tests.harness import assert_rel_close, rank_slice, run_on_ranks, token_batch

CFG = GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, d_model=12)
POLICY = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _errors_and_warnings(ctx):
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        FSDP(_gpt(), bogus=1)
    with pytest.raises(ValueError, match="use_orig_params=False is not supported.*original"):
        FSDP(_gpt(), use_orig_params=False)
    with pytest.raises(ValueError, match="process_group=\\(shard group, replicate group\\)"
                                         " or a 2D device_mesh; one group is ambiguous"):
        FSDP(_gpt(), sharding_strategy=TorchShardingStrategy.HYBRID_SHARD,
             process_group=ctx.group)
    with pytest.raises(ValueError, match="goes with a HYBRID sharding_strategy"):
        FSDP(_gpt(), process_group=(ctx.group, ctx.group))
    with pytest.raises(ValueError, match="a 2D device_mesh means hybrid sharding"):
        FSDP(_gpt(), device_mesh=init_device_mesh("cpu", (1, ctx.world_size)))
    with pytest.raises(ValueError, match="sharding_strategy must be one of"):
        FSDP(_gpt(), sharding_strategy="SOMETIMES")
    fsdp1_args._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(_gpt(), backward_prefetch=TorchBackwardPrefetch.BACKWARD_PRE)  # the default
        assert not caught
        for _ in range(2):
            FSDP(_gpt(), backward_prefetch=TorchBackwardPrefetch.BACKWARD_POST,
                 limit_all_gathers=False)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # each argument once, not once per construction
    assert "backward_prefetch" in messages[0] and "limit_all_gathers" in messages[1]


def test_constructor_errors_and_warnings():
    run_on_ranks(2, _errors_and_warnings)


def _losses(model, ctx, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(steps):
        x, y = token_batch(step, 1, 8, CFG.seq_len, CFG.vocab_size)
        loss = lm_loss(model(rank_slice(x[0], ctx.rank, ctx.world_size)),
                       rank_slice(y[0], ctx.rank, ctx.world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _torch_config_objects(ctx):
    """torch's MixedPrecision / CPUOffload / ShardingStrategy give what ours give."""
    ours = _losses(FSDP(_gpt(), auto_wrap_policy=POLICY,
                        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), ctx)
    theirs = _losses(FSDP(_gpt(), auto_wrap_policy=POLICY,
                          mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16),
                          cpu_offload=TorchCPUOffload(offload_params=True),
                          sharding_strategy=TorchShardingStrategy.SHARD_GRAD_OP), ctx)
    assert ours == theirs
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    plain = _losses(FSDP(_gpt(), auto_wrap_policy=POLICY), ctx)
    assert _losses(FSDP(_gpt(), auto_wrap_policy=POLICY, device_mesh=mesh), ctx) == plain


def test_torch_config_objects_and_device_mesh():
    run_on_ranks(2, _torch_config_objects)


def _ignored_modules(ctx):
    """An ignored module keeps plain parameters whose gradient is this rank's own (unreduced),
    and is not wrapped; the rest is sharded and averaged."""
    model = _gpt()
    reference = _gpt()
    ignored = model.blocks[1]
    fsdp = FSDP(model, auto_wrap_policy=POLICY, ignored_modules=[ignored])
    assert not any(isinstance(p, DTensor) for p in ignored.parameters())
    assert all(isinstance(p, DTensor) for p in model.blocks[0].parameters())
    x, y = token_batch(0, 1, 8, CFG.seq_len, CFG.vocab_size)
    xr, yr = rank_slice(x[0], ctx.rank, ctx.world_size), rank_slice(y[0], ctx.rank,
                                                                    ctx.world_size)
    lm_loss(fsdp(xr), yr).backward()
    lm_loss(reference(xr), yr).backward()  # this rank's data only
    for (name, p), q in zip(ignored.named_parameters(), reference.blocks[1].parameters()):
        assert_rel_close(p.grad, q.grad, 1e-5, f"ignored {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_ignored_modules(world_size):
    run_on_ranks(world_size, _ignored_modules)


def _param_init_fn(ctx):
    with torch.device("meta"):
        model = GPT(CFG)
    called = []

    def init(module: nn.Module) -> None:
        called.append(module)
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.fill_(0.25)

    fsdp = FSDP(model, auto_wrap_policy=POLICY, param_init_fn=init)
    owners = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert called == owners  # each module with meta tensors of its own, once, parents first
    with FSDP.summon_full_params(fsdp):
        for name, p in fsdp.named_parameters():
            assert torch.equal(p, torch.full_like(p, 0.25)), name


def test_param_init_fn():
    run_on_ranks(2, _param_init_fn)
