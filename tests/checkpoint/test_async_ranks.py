"""async_save on several ranks while training goes on (collectives in the caller's thread): the
checkpoint holds the state at the call, is committed when every rank's future is done, and the
next save waits for it."""

from __future__ import annotations

import pytest
import torch

from shardwise.checkpoint import async_save, get_state_dict, inspect
from tests.checkpoint import strategies as S
from tests.harness import run_on_ranks


def _async_then_train(ctx, strategy: str, path: str):
    wrapped, opt, model = S.build(strategy, ctx.group, seed=0)
    S.train(strategy, wrapped, opt, range(2), ctx.group)
    before = S.full_state(strategy, model, opt, ctx.group)
    msd, osd = get_state_dict(wrapped, opt)
    futures = [async_save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=path)]
    S.train(strategy, wrapped, opt, range(2, 4), ctx.group)  # state changes while it writes
    futures.append(async_save({"model": msd, "optim": osd, "step": 4},
                              checkpoint_id=path + "-b"))  # waits for the first
    for f in futures:
        f.result(timeout=120)
    assert inspect(path)["values"]["step"] == 2  # committed: visible to every rank
    return before if ctx.rank == 0 else None


@pytest.mark.parametrize(("strategy", "world", "dst", "dst_world"),
                         [("fsdp", 2, "zero2", 4), ("zero1", 4, "tp", 2)])
def test_async_save_on_ranks(tmp_path, strategy, world, dst, dst_world):
    path = str(tmp_path / "ck")
    before = run_on_ranks(world, _async_then_train, strategy, path)[0]
    loaded, _, step = run_on_ranks(dst_world, S.load_and_train, dst, path, 2, 1)[0]
    assert step == 2
    for key, value in before.items():
        assert torch.equal(loaded[key], value), key
