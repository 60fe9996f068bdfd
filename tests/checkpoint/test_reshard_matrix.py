"""Save under one strategy and world size, load under another (the matrix of issue 13): the
loaded model and AdamW state equal the saved ones exactly, and 5 more steps give the losses of
one process continuing from the saved state (1e-6)."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint import strategies as S
from tests.harness import max_rel_diff, run_on_ranks

STEPS, MORE = 3, 5
PAIRS = [
    (("fsdp", 4), ("ddp", 2)),
    (("fsdp", 4), ("plain", 1)),
    (("fsdp", 4), ("tp", 2)),
    (("fsdp", 4), ("zero2", 4)),
    (("zero2", 4), ("fsdp", 4)),
    (("ddp", 2), ("zero1", 4)),
    (("zero1", 2), ("fsdp", 2)),
    (("tp", 4), ("zero1", 2)),
    (("tp", 2), ("fsdp", 4)),
    (("plain", 1), ("tp", 4)),
    (("zero2", 2), ("ddp", 1)),
    (("fsdp", 2), ("fsdp", 4)),
    (("hsdp", 4), ("fsdp", 2)),
    (("zero1", 4), ("hsdp", 4)),
]

_saved: dict[tuple[str, int], tuple[str, dict]] = {}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix")


def _saved_under(root, strategy: str, world: int) -> tuple[str, dict]:
    key = (strategy, world)
    if key not in _saved:
        path = str(root / f"{strategy}_x{world}")
        full = run_on_ranks(world, S.train_and_save, strategy, path, STEPS)[0]
        _saved[key] = path, full
    return _saved[key]


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}x{n}-to-{b}x{m}"
                                                      for (a, n), (b, m) in PAIRS])
def test_save_then_load_elsewhere(ckpt_root, src, dst):
    path, saved = _saved_under(ckpt_root, *src)
    results = run_on_ranks(dst[1], S.load_and_train, dst[0], path, STEPS, MORE)
    loaded, losses, step = results[0]
    assert step == STEPS
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), f"{key} differs after {src} -> {dst}"
    expected = S.reference_losses(saved, range(STEPS, STEPS + MORE))
    for rank, (_, rank_losses, _) in enumerate(results):
        for got, want in zip(rank_losses, expected, strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (rank, rank_losses, expected)


def test_saved_state_matches_one_process(ckpt_root):
    """The state saved under FSDP x4 is the one-process model's after the same steps."""
    _, saved = _saved_under(ckpt_root, "fsdp", 4)
    _, plain = _saved_under(ckpt_root, "plain", 1)
    for key, value in plain.items():
        assert max_rel_diff(saved[key], value) < 1e-5, key


def test_hsdp_replicas_written_once(ckpt_root):
    """(Replicate(), Shard(0)) on a 2x2 mesh: only ranks 0 and 1 (coordinate 0 of the
    replicating dim) write chunks; the other replica's ranks write only what no one else has."""
    from shardwise.checkpoint import inspect

    path, _ = _saved_under(ckpt_root, "hsdp", 4)
    info = inspect(path)["tensors"]
    files = {c["file"] for name, t in info.items() if name.startswith("model.")
             for c in t["chunks"]}
    assert files == {"rank_00000.bin", "rank_00001.bin"}
    assert len(info["model.blocks.0.mlp.fc1.weight"]["chunks"]) == 2
