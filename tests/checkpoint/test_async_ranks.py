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


def _fail_on_rank1(ctx, path: str) -> str:
    from shardwise.checkpoint import CheckpointError, save

    def hook(point, index):
        if point == "parts" and ctx.rank == 1:
            raise OSError("no space left (simulated)")

    try:
        save({"w": torch.ones(4) * ctx.rank}, checkpoint_id=path, _fault_hook=hook)
    except CheckpointError as err:
        return str(err)
    return "no error"


def test_write_failure_on_one_rank_raised_on_all(tmp_path):
    messages = run_on_ranks(2, _fail_on_rank1, str(tmp_path / "ck"))
    for text in messages:
        assert "save failed while writing: rank 1: OSError: no space left" in text
    assert not (tmp_path / "ck").exists()


def test_load_into_other_shapes_lists_them(tmp_path):
    from shardwise.checkpoint import CheckpointError, load
    from shardwise.models import GPT, GPTConfig

    path = str(tmp_path / "ck")
    run_on_ranks(2, S.train_and_save, "fsdp", path, 1)
    other = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=4, d_model=32))
    with pytest.raises(CheckpointError) as err:
        load({"model": other.state_dict()}, checkpoint_id=path, strict=True)
    text = str(err.value)
    assert "model.blocks.0.mlp.fc1.weight: checkpoint (64, 16), requested (128, 32)" in text
    assert "unexpected keys" in text and "'model.blocks.1.attn.qkv.weight'" in text


def test_a_save_directory_committed_while_a_rank_lists_it_is_no_failure(tmp_path, monkeypatch):
    """Rank 0's commit renames ``<id>.tmp`` away; a rank listing it for failure records at that
    moment finds it gone (between pathlib's is-a-directory check and its scan)."""
    from pathlib import Path

    from shardwise.checkpoint import commit

    tmp = tmp_path / "ck.tmp"
    tmp.mkdir()

    def renamed_away(self, pattern):
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "glob", renamed_away)
    commit.check_failures(tmp, plan=None)  # returns: nothing was recorded
