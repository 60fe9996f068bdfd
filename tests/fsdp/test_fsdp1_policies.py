"""Auto-wrap policies with torch's signature pick exactly the modules torch's FSDP1 would wrap.

torch's own recursion (``torch.distributed.fsdp.wrap._recursive_wrap`` with a wrapper that only
records) is the reference: for torch's policy functions bound with ``functools.partial`` (the
documented idiom), for ours under the same names, and for the policy objects. No processes.
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

from shardwise.fsdp import (
    ModuleWrapPolicy,
    SizeBasedWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shardwise.fsdp.fsdp1.policies import modules_to_wrap
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import MLP, Block

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)


class Tower(nn.Module):
    """Nested containers, an attention module and a shared child, to exercise every rule."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
                                    for _ in range(3))
        self.attn = nn.MultiheadAttention(16, 2)
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 8), "b": nn.Linear(16, 300)})


def _torch_picks(model: nn.Module, policy) -> list[str]:
    picked = []
    names = {id(m): n for n, m in model.named_modules()}

    def record(module, **kwargs):
        picked.append(names[id(module)])
        return module

    torch_wrap._recursive_wrap(model, policy, record, set(), set(), only_wrap_children=True)
    return picked


def _our_picks(model: nn.Module, policy) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in modules_to_wrap(model, policy)]


MODELS = {"gpt": lambda: GPT(CFG), "tower": Tower}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("min_num_params", [1, 500, 2_000, 5_000, 10**9])
def test_size_based_partial_matches_torch(model_name, min_num_params):
    model = MODELS[model_name]()
    theirs = _torch_picks(model, functools.partial(torch_wrap.size_based_auto_wrap_policy,
                                                   min_num_params=min_num_params))
    ours = _our_picks(model, functools.partial(size_based_auto_wrap_policy,
                                               min_num_params=min_num_params))
    assert ours == theirs
    # torch's function itself and our class agree too
    assert _our_picks(model, functools.partial(torch_wrap.size_based_auto_wrap_policy,
                                               min_num_params=min_num_params)) == theirs
    assert _our_picks(model, SizeBasedWrapPolicy(min_num_params)) == theirs


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("classes", [{Block}, {Block, MLP}, {nn.Linear}, {nn.Sequential}])
def test_transformer_partial_matches_torch(model_name, classes):
    model = MODELS[model_name]()
    theirs = _torch_picks(model, functools.partial(torch_wrap.transformer_auto_wrap_policy,
                                                   transformer_layer_cls=classes))
    ours = _our_picks(model, functools.partial(transformer_auto_wrap_policy,
                                               transformer_layer_cls=classes))
    assert ours == theirs
    assert _our_picks(model, ModuleWrapPolicy(classes)) == theirs
    # torch's ModuleWrapPolicy object goes through its own selection (_run_policy)
    assert _our_picks(model, torch_wrap.ModuleWrapPolicy(classes)) == theirs
    if model_name == "gpt" and classes == {Block}:
        assert theirs == ["blocks.0", "blocks.1", "blocks.2"]


def test_lambda_always_and_custom_policies():
    model = Tower()
    is_linear = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    theirs = _torch_picks(model, functools.partial(torch_wrap.lambda_auto_wrap_policy,
                                                   lambda_fn=is_linear))
    assert _our_picks(model, functools.partial(lambda_auto_wrap_policy,
                                               lambda_fn=is_linear)) == theirs
    assert _our_picks(model, torch_wrap.always_wrap_policy) == _torch_picks(
        model, torch_wrap.always_wrap_policy)
    assert _our_picks(model, always_wrap_policy) == _torch_picks(model,
                                                                 torch_wrap.always_wrap_policy)
    assert _our_picks(model, torch_wrap.CustomPolicy(is_linear)) == theirs
    overriding = torch_wrap.CustomPolicy(lambda m: {"sharding_strategy": 1} if is_linear(m)
                                         else False)
    with pytest.raises(NotImplementedError, match="per-module keyword overrides"):
        modules_to_wrap(model, overriding)
    with pytest.raises(TypeError, match="must be callable as policy"):
        modules_to_wrap(model, 3)


def test_ignored_modules_are_neither_asked_nor_counted():
    model = Tower()
    asked = []

    def policy(module, recurse, nonwrapped_numel):
        asked.append(module)
        return recurse or isinstance(module, nn.Linear)

    picked = modules_to_wrap(model, policy, ignored_modules=[model.layers])
    assert model.layers not in asked and model.layers[0][0] not in asked
    assert picked == [model.attn.out_proj, model.heads["a"], model.heads["b"]]
    # ignored parameters do not count towards a module's size
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=16 * 300)
    assert model.heads["b"] in modules_to_wrap(model, size)
    assert model.heads["b"] not in modules_to_wrap(model, size,
                                                   ignored_params=[model.heads["b"].weight])
