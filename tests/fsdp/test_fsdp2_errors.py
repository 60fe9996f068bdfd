"""Bad input to the FSDP2-style API gets an error that names the problem."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from shardwise import MixedPrecision, MixedPrecisionPolicy, fully_shard
from shardwise.models import GPT, GPTConfig
from tests.harness import run_on_ranks

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))


def _sharded_gpt():
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _errors(ctx):
    model = _sharded_gpt()
    with pytest.raises(RuntimeError, match="Block ran forward before the root unit GPT"):
        model.blocks[0](torch.randn(1, CFG.seq_len, CFG.d_model))
    with pytest.raises(ValueError, match=r"3D mesh of shape \(1, 2, 1\)"):
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 2, 1)))
    with pytest.raises(ValueError, match="reshard_after_forward=2: only True or False"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=2)
    with pytest.raises(ValueError, match=r"Shard\(dim=1\) for weight: only Shard\(0\)"):
        fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(ValueError, match="scale is a scalar"):
        fully_shard(_Scalar())
    with pytest.raises(TypeError, match="mesh= or process_group=, not both"):
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (2,)),
                    process_group=ctx.group)
    with pytest.raises(TypeError, match="mp_policy= or mixed_precision=, not both"):
        fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(),
                    mixed_precision=MixedPrecision())
    with pytest.raises(ValueError, match="Linear is not sharded: apply fully_shard"):
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="reshard_after_backward must be a bool"):
        model.set_reshard_after_backward(1)
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(model)
    with pytest.raises(ValueError, match="a module appears in it twice"):
        fully_shard([nn.Linear(2, 2)] * 2)  # the list form itself: tests/fsdp/test_module_list.py
    with pytest.raises(TypeError, match="needs an nn.Module, got int"):
        fully_shard(3)


def test_fsdp2_bad_input_errors():
    run_on_ranks(2, _errors)
