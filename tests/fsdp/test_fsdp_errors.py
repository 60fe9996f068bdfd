"""Bad input gets an error that names the problem."""

import pytest
import torch
from torch import nn

from shardwise import FullyShardedDataParallel, fully_shard
from shardwise.fsdp import full_state_dict, load_full_state_dict
from shardwise.fsdp.fully_shard import check_backend_device
from shardwise.models import GPT, GPTConfig
from tests.harness import run_on_ranks

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


class _TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, device="meta")


def _errors(ctx):
    with pytest.raises(ValueError, match=r"different devices.*cpu: a.weight, a.bias.*meta"):
        fully_shard(_TwoDevices())

    model = GPT(CFG)
    fully_shard(model.blocks[0])
    with pytest.raises(RuntimeError, match="already applied to this Block"):
        fully_shard(model.blocks[0])

    tied = GPT(CFG)
    tied.blocks[0].attn.proj.weight = tied.blocks[1].attn.proj.weight
    fully_shard(tied.blocks[1])
    with pytest.raises(ValueError, match=r"blocks.0.attn.proj.weight is shared with attn.proj"):
        fully_shard(tied)

    torch.manual_seed(0)
    plain = GPT(CFG)
    wrapped = FullyShardedDataParallel(GPT(CFG))
    state = plain.state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["head.weight"]
    with pytest.raises(KeyError, match=r"missing keys \['head.weight'\], unexpected keys "
                                       r"\['extra.weight'\]"):
        wrapped.load_state_dict(state)
    with pytest.raises(KeyError, match=r"missing keys \['head.weight'\]"):
        load_full_state_dict(wrapped, state)
    state = plain.state_dict()
    state["ln_f.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"ln_f.weight has shape \(3,\), the parameter has"):
        wrapped.load_state_dict(state)
    # a good one loads, and reads back equal
    wrapped.load_state_dict(plain.state_dict())
    for key, value in full_state_dict(wrapped).items():
        torch.testing.assert_close(value, plain.state_dict()[key])


def test_bad_input_errors():
    run_on_ranks(2, _errors)


def test_nccl_with_cpu_parameters_is_rejected():
    with pytest.raises(ValueError, match="NCCL, which communicates only CUDA tensors.*"
                                         "cpu with cpu_offload"):
        check_backend_device("nccl", torch.device("cpu"), offload=True)
    with pytest.raises(ValueError, match="move the module to its CUDA device"):
        check_backend_device("nccl", torch.device("cpu"), offload=False)
    check_backend_device("gloo", torch.device("cpu"), offload=True)
    check_backend_device("nccl", torch.device("cuda", 0), offload=True)
