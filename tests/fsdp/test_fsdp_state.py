"""Full state dict on rank 0 only, sharded state dict round trip, and gradient clipping."""

import pytest
import torch

from shardwise import FullyShardedDataParallel
from shardwise.fsdp import (
    ModuleWrapPolicy,
    clip_grad_norm_,
    full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.models.gpt import Block
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _state_and_clip(ctx, norm_type):
    torch.manual_seed(0)
    reference = GPT(CFG)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(GPT(CFG), auto_wrap_policy=ModuleWrapPolicy({Block}))
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1),
                      generator=torch.Generator().manual_seed(3))
    per = 4 // ctx.world_size
    xr = x[ctx.rank * per : (ctx.rank + 1) * per]
    lm_loss(model(xr[:, :-1]), xr[:, 1:]).backward()
    sum(lm_loss(reference(x[r * per : (r + 1) * per, :-1]), x[r * per : (r + 1) * per, 1:])
        / ctx.world_size for r in range(ctx.world_size)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
    norm = model.clip_grad_norm_(0.05, norm_type)
    assert_rel_close(norm, ref_norm, 1e-5, "total norm")
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    state = full_state_dict(model, rank0_only=True)
    if ctx.rank == 0:
        for key, value in reference.state_dict().items():
            assert_rel_close(state[key], value, 1e-5, key)
    else:
        assert state == {}
    # sharded round trip: save, perturb, load back
    saved = sharded_state_dict(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_sharded_state_dict(model, saved)
    for key, value in full_state_dict(model).items():
        assert_rel_close(value, reference.state_dict()[key], 1e-5, key)
    assert clip_grad_norm_(model, 1e9) > 0  # the function form on a module


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_and_state_dicts(world_size, norm_type):
    run_on_ranks(world_size, _state_and_clip, norm_type)
