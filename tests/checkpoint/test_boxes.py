"""Pure pieces: box overlap, tiling checks, flattening of nested state dicts, block sizes."""

from __future__ import annotations

import pytest
import torch

from shardwise.checkpoint.boxes import check_cover, rows_and_row_numel
from shardwise.checkpoint.flatten import flatten
from shardwise.checkpoint.format import BLOCK_BYTES
from shardwise.checkpoint.writer import block_rows
from shardwise.sharded_tensor.metadata import intersect


def test_intersect():
    assert intersect(((0, 0), (4, 6)), ((2, 3), (4, 6))) == ((2, 3), (2, 3))
    assert intersect(((0, 0), (4, 6)), ((4, 0), (4, 6))) is None  # touching is not overlapping
    assert intersect(((), ()), ((), ())) == ((), ())


def test_check_cover():
    check_cover("t", (4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))])
    with pytest.raises(ValueError, match="cover 12 of the 24"):
        check_cover("t", (4, 6), [((0, 0), (2, 6))])
    with pytest.raises(ValueError, match="overlapping"):
        check_cover("t", (4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))])
    check_cover("t", (), [((), ())])


def test_flatten_keys_and_values():
    state = {"model": {"w": torch.zeros(2)}, "optim": {"state": {"w": {"step": torch.zeros(())}},
             "param_groups": [{"lr": 0.1, "params": ["w"]}]}, "ids": [torch.ones(1), 3]}
    flat = flatten(state)
    assert sorted(flat) == ["ids.0", "ids.1", "model.w", "optim.param_groups",
                            "optim.state.w.step"]
    assert flat["optim.param_groups"].value == [{"lr": 0.1, "params": ["w"]}]
    with pytest.raises(ValueError, match="same key 'a.b'"):
        flatten({"a.b": 1, "a": {"b": 2}})


def test_block_rows():
    assert rows_and_row_numel(()) == (1, 1)
    assert rows_and_row_numel((5, 3, 2)) == (5, 6)
    assert block_rows((1000, 1024), 4) == BLOCK_BYTES // 4096
    assert block_rows((2, BLOCK_BYTES), 4) == 1  # a row over the block size is its own block
