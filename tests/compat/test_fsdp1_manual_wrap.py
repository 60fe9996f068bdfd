"""torch FSDP1's manual wrapping (the FSDP1 tutorial's ``enable_wrap`` / ``wrap``), run with
``torch.distributed.fsdp.wrap`` and with ``shardwise.fsdp.wrap``: each layer wrapped where it is
built, one layer with a keyword overriding the context's, the root wrapped last; the same
losses and final parameters. Outside the context ``wrap`` returns its module, and contexts do
not nest, in both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.compat.models import Transformer
from tests.compat.models import batch as _batch
from tests.harness import assert_rel_close, reference_train, run_on_ranks

RTOL = 1e-5


def _api(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import enable_wrap, wrap
    else:
        from shardwise.fsdp import FullyShardedDataParallel, ShardingStrategy
        from shardwise.fsdp.wrap import enable_wrap, wrap
    return FullyShardedDataParallel, ShardingStrategy, enable_wrap, wrap


def _build(wrap, strategy) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer()
    layers = [wrap(layer) for layer in model.layers[:-1]]
    layers.append(wrap(model.layers[-1], sharding_strategy=strategy.SHARD_GRAD_OP))
    model.layers = nn.ModuleList(layers)
    return wrap(model)


def _program(ctx, impl):
    FSDP, ShardingStrategy, enable_wrap, wrap = _api(impl)
    plain = nn.Linear(2, 2)
    unchanged = wrap(plain) is plain
    received = []  # the keywords each wrapper was built with

    def wrapper_cls(module, **kwargs):
        received.append(kwargs["sharding_strategy"].name)
        return FSDP(module, **kwargs)

    with enable_wrap(wrapper_cls=wrapper_cls, device_id=torch.device("cpu"),
                     sharding_strategy=ShardingStrategy.FULL_SHARD):
        try:
            with enable_wrap(wrapper_cls=FSDP):
                nested = None
        except NotImplementedError:
            nested = "refused"
        model = _build(wrap, ShardingStrategy)
    kinds = [isinstance(m, FSDP) for m in (model, *model.module.layers)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y, _, _ = _batch(step, ctx.rank, ctx.world_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / ctx.world_size)
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in params.items()}
    return unchanged, nested, kinds, received, losses, params


def _reference(world_size: int) -> list[float]:
    def loss(model, step):
        _, _, x, y = _batch(step, 0, world_size)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return reference_train(Transformer, loss,
                           lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 3).losses


@pytest.mark.parametrize("world_size", (2,))
def test_enable_wrap_and_wrap_like_torch(world_size):
    ours = run_on_ranks(world_size, _program, "shardwise")[0]
    theirs = run_on_ranks(world_size, _program, "torch")[0]
    assert ours[:4] == theirs[:4] == (
        True, "refused", [True] * 4,
        ["FULL_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"])
    for loss, t_loss, ref in zip(ours[4], theirs[4], _reference(world_size)):
        assert abs(loss - t_loss) <= RTOL * abs(t_loss), (ours[4], theirs[4])
        assert abs(loss - ref) <= RTOL * abs(ref), (ours[4], ref)
    assert ours[5].keys() == theirs[5].keys()
    for key, value in theirs[5].items():
        assert_rel_close(ours[5][key], value, 1e-4, key)


def test_wrap_module_is_callable_and_context_resets_after_an_error():
    import shardwise.fsdp
    from shardwise.fsdp.wrap import enable_wrap

    built = []

    def wrapper_cls(module, **kwargs):
        built.append(kwargs)
        return module

    layer = nn.Linear(2, 2)
    layer._wrap_overrides = {"b": "module's"}  # torch's auto-wrap sets this; it wins
    with pytest.raises(RuntimeError, match="inside"), \
            enable_wrap(wrapper_cls=wrapper_cls, a=1, b=2):
        assert shardwise.fsdp.wrap(layer, a=3) is layer  # the package attribute wraps too
        raise RuntimeError("inside")
    assert built == [{"a": 3, "b": "module's"}]
    assert shardwise.fsdp.wrap(layer) is layer and len(built) == 1  # the context is gone
    with pytest.raises(TypeError, match="wrapper_cls"), enable_wrap(wrapper_cls=None):
        pass
