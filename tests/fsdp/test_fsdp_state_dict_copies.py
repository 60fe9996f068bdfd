"""``torch.save(model.state_dict(), path)``, ``copy.deepcopy(model.state_dict())`` and torch DCP's
``async_save(model.state_dict())`` on a model sharded by ``fully_shard``, as users write them (a
checkpoint per rank, the best weights kept for early stopping, a checkpoint staged while
training goes on). All three failed for every parameter after a unit's first ("Attempted to
call copy_() on an invalid python storage"): see [Note: a local tensor at the start of its
storage], fsdp/layout.py. torch's FSDP2 does all three."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from shardwise import fully_shard
from tests.fsdp.gathering import gathering_units
from tests.harness import WORLD_SIZES, run_on_ranks

WIDTH = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _sharded(gather: bool, seed: int) -> Net:
    torch.manual_seed(seed)
    model = Net()
    with gathering_units() if gather else contextlib.nullcontext():
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copies(ctx, gather: bool, tmp: str) -> None:
    model = _sharded(gather, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    kept = copy.deepcopy(model.state_dict())  # the best weights so far
    grads = copy.deepcopy([p.grad for p in model.parameters()])
    path = f"{tmp}/rank{ctx.rank}.pt"
    torch.save(model.state_dict(), path)
    before = {k: _local(v).clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()  # the model moves on; the copies must not
    for key, value in kept.items():
        assert torch.equal(_local(value), before[key]), f"the deep copy of {key} moved"
    for grad, p in zip(grads, model.parameters()):
        assert grad is not None and grad.shape == p.shape
    fresh = _sharded(gather, seed=1)
    fresh.load_state_dict(torch.load(path, weights_only=False))
    for key, value in fresh.state_dict().items():
        assert torch.equal(_local(value), before[key]), f"{key} after torch.load"
    fresh.load_state_dict(kept)
    for key, value in fresh.state_dict().items():
        assert torch.equal(_local(value), before[key]), f"{key} after the deep copy's load"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_save_and_deepcopy_of_the_state_dict(world_size, tmp_path):
    run_on_ranks(world_size, _copies, False, str(tmp_path))


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_same_where_units_gather(world_size, tmp_path):
    run_on_ranks(world_size, _copies, True, str(tmp_path))


def _dcp_async_save(ctx, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = _sharded(False, seed=0)
    dcp.async_save({"model": model.state_dict()}, checkpoint_id=path).result()
    fresh = _sharded(False, seed=1)
    state = fresh.state_dict()
    dcp.load({"model": state}, checkpoint_id=path)
    fresh.load_state_dict(state)
    for (key, value), mine in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(_local(mine), _local(value)), key


def test_torch_dcp_async_save_of_the_state_dict_as_it_is(tmp_path):
    run_on_ranks(2, _dcp_async_save, str(tmp_path / "ckpt"))
