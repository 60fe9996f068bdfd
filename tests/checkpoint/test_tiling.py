"""Tiling validation in O(n log n) whichever dims the chunks split (issue 46 point 6), with the
same strictness ([Note: exact tiling by corner counts] in checkpoint/tiling.py), and the bound
on ``metadata.json``'s size, checked before it is parsed.

A checkpoint of a ``[1, N]`` tensor stored as N one-element chunks (a column tiling) is valid;
the sweep along dim 0 that validation used before compared every chunk with every other (1.1 s
at N = 1,000, 20 s at 4,000). Here it is validated at N = 4,000 and 100,000 by every reader's
first step (``read_metadata``) and loaded. Exact answers are checked against counting every
element on random small tilings (row, column, grid and guillotine layouts, damaged at random).
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.checkpoint import CheckpointError, inspect, load
from shardwise.checkpoint.boxes import check_cover
from shardwise.checkpoint.format import MAX_METADATA_VAR, rank_file
from shardwise.checkpoint.tiling import tiling_fault
from shardwise.checkpoint.validate import digest_of, read_metadata


def write_checkpoint(root: Path, shape: tuple[int, ...], boxes: list) -> torch.Tensor:
    """A checkpoint of one float32 tensor ``w`` = arange over ``shape``, each box a chunk of
    rank file 0 (row-major, one block per chunk), its metadata signed. Returns the tensor."""
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    root.mkdir(parents=True)
    chunks, data, at = [], [], 0
    for offsets, sizes in boxes:
        raw = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].tobytes()
        rows = sizes[0] if sizes else 1
        chunks.append({"file": rank_file(0), "byte_offset": at, "nbytes": len(raw),
                       "offsets": list(offsets), "sizes": list(sizes),
                       "block_rows": max(rows, 1), "crc32": [zlib.crc32(raw)] if raw else []})
        data.append(raw)
        at += len(raw)
    (root / rank_file(0)).write_bytes(b"".join(data))
    meta = {"format": "shardwise-checkpoint", "version": 2, "token": "t", "world_size": 1,
            "files": {rank_file(0): at}, "values": {}, "paths": {"w": ["w"]},
            "tensors": {"w": {"shape": list(shape), "dtype": "float32", "chunks": chunks}}}
    meta["digest"] = digest_of(meta)
    (root / "metadata.json").write_text(json.dumps(meta, separators=(",", ":")))
    return torch.from_numpy(full)


def columns(n: int) -> list:
    return [((0, j), (1, 1)) for j in range(n)]


def rows(n: int) -> list:
    return [((i, 0), (1, 1)) for i in range(n)]


def grid(r: int, c: int, h: int = 2, w: int = 3) -> list:
    return [((i * h, j * w), (h, w)) for i in range(r) for j in range(c)]


def test_a_column_tiling_is_validated_and_loaded(tmp_path):
    full = write_checkpoint(tmp_path / "ck", (1, 4000), columns(4000))
    assert len(read_metadata(tmp_path / "ck")["tensors"]["w"]["chunks"]) == 4000
    target = {"w": torch.zeros(1, 4000)}
    load(target, checkpoint_id=tmp_path / "ck")
    assert torch.equal(target["w"], full)


def test_a_column_tiling_of_100000_chunks_is_validated(tmp_path):
    """What every reader does first (``load`` reads the chunks after it: one by one)."""
    write_checkpoint(tmp_path / "ck", (1, 100_000), columns(100_000))
    assert len(read_metadata(tmp_path / "ck")["tensors"]["w"]["chunks"]) == 100_000


def test_row_and_grid_tilings_of_many_chunks_are_valid():
    check_cover("w", (20_000, 1), rows(20_000))
    check_cover("w", (2 * 100, 3 * 100), grid(100, 100))
    brick = [((0, j), (j + 1, 1)) for j in range(2000)] + \
            [((j + 1, j), (2000 - j, 1)) for j in range(2000)]  # each column split at its own row
    check_cover("w", (2001, 2000), brick)


# (layout, shape, boxes, a damaged copy, what the error says)
def _damage_cases() -> list:
    col, row, g = columns(50), rows(50), grid(4, 5)
    return [
        ("column-overlap", (1, 50), col[:10] + [((0, 9), (1, 2))] + col[11:],
         r"overlapping .* \(0, 9\)"),  # one chunk [9, 11) where [10, 11) was: 9 twice
        ("column-gap", (1, 50), col[:20] + col[21:], r"cover 49 of the 50 elements .*\(0, 20\)"),
        ("column-outside", (1, 50), col[:-1] + [((0, 50), (1, 1))], r"lies outside"),
        ("row-overlap", (50, 1), row + [((25, 0), (1, 1))], r"overlapping .* \(25, 0\)"),
        ("row-gap", (50, 1), row[1:], r"cover 49 of the 50 elements .*\(0, 0\)"),
        ("row-outside", (50, 1), row[:-1] + [((49, 0), (2, 1))], r"lies outside"),
        ("grid-overlap", (8, 15), g[:7] + [((2, 4), (2, 3))] + g[8:],
         r"overlapping .* \(2, 4\)"),  # chunk (1, 2) moved one column left
        ("grid-gap", (8, 15), g[:19], r"cover 114 of the 120 elements .*\(6, 12\)"),
        ("grid-outside", (8, 15), g[:19] + [((6, 13), (2, 3))], r"lies outside"),
        ("grid-negative", (8, 15), [((-2, 0), (2, 3))] + g[1:], r"lies outside"),
    ]


@pytest.mark.parametrize("case", _damage_cases(), ids=lambda c: c[0])
def test_damaged_tilings_are_refused_by_name(case, tmp_path):
    name, shape, boxes, says = case
    with pytest.raises(ValueError, match=says):
        check_cover("w", shape, boxes)
    if "outside" in name or "negative" in name:
        return  # on disk these fail earlier (a negative offset is a schema error)
    write_checkpoint(tmp_path / "ck", shape, boxes)
    with pytest.raises(CheckpointError, match=r"tensors\['w'\]: w: .*" + says):
        read_metadata(tmp_path / "ck")


def test_sizes_that_add_up_but_overlap_are_refused():
    """Volume right, tiling wrong: [0, 6) and [4, 10) hold 4 and 5 twice; 10, 11 by none."""
    with pytest.raises(ValueError, match=r"overlapping .* \(0, 4\)"):
        check_cover("w", (1, 12), [((0, 0), (1, 6)), ((0, 4), (1, 6))])
    with pytest.raises(ValueError, match=r"the chunks overlap: their sizes add up to 12 "
                                         r"elements, .* none holds the element at \(0, 0\)"):
        check_cover("w", (1, 12), [((0, 1), (1, 6)), ((0, 6), (1, 6))])


# -- exact answers against counting every element ---------------------------------------------

def _guillotine(rng: random.Random, offsets: list, sizes: list, out: list, depth: int) -> None:
    """Split a box at random until small: an exact tiling of it."""
    dims = [d for d, n in enumerate(sizes) if n > 1]
    if not dims or depth == 0 or rng.random() < 0.2:
        out.append((tuple(offsets), tuple(sizes)))
        return
    d = rng.choice(dims)
    cut = rng.randrange(1, sizes[d])
    for lo, n in ((0, cut), (cut, sizes[d] - cut)):
        o, s = list(offsets), list(sizes)
        o[d] += lo
        s[d] = n
        _guillotine(rng, o, s, out, depth - 1)


def _pinwheel() -> tuple[tuple, list]:
    """Five boxes tiling 3x3 that no single cut separates."""
    return (3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)),
                    ((1, 1), (1, 1))]


def _damaged(rng: random.Random, shape: tuple, boxes: list) -> list:
    boxes = list(boxes)
    what = rng.randrange(5)
    i = rng.randrange(len(boxes))
    o, s = map(list, boxes[i])
    d = rng.randrange(len(shape))
    if what == 0:
        del boxes[i]
    elif what == 1:
        boxes.append(boxes[i])
    elif what == 2 and o[d] > 0:  # moved towards 0: an overlap and a gap
        o[d] -= 1
        boxes[i] = (tuple(o), tuple(s))
    elif what == 3 and s[d] > 1:  # shrunk: a gap
        s[d] -= 1
        boxes[i] = (tuple(o), tuple(s))
    elif what == 4 and o[d] + s[d] < shape[d]:  # grown: an overlap
        s[d] += 1
        boxes[i] = (tuple(o), tuple(s))
    return boxes


def _counts(shape: tuple, boxes: list) -> np.ndarray:
    held = np.zeros(shape, dtype=np.int64)
    for o, s in boxes:
        held[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
    return held


def _check_against_counts(shape: tuple, boxes: list) -> bool:
    held = _counts(shape, boxes)
    fault = tiling_fault(shape, boxes)
    if fault is None:
        assert (held == 1).all(), (shape, boxes)
        return True
    assert not (held == 1).all(), (shape, boxes)
    if fault.kind == "overlap":
        assert held[fault.point] >= 2
        for i in (fault.first, fault.second):
            o, s = boxes[i]
            assert all(a <= x < a + n for a, n, x in zip(o, s, fault.point))
    else:
        assert fault.kind == "gap" and held[fault.point] == 0, fault
        assert fault.covered == sum(int(np.prod(s)) for _, s in boxes)
    return False


def test_exact_answers_match_counting_every_element():
    rng = random.Random(46)
    valid = damaged = 0
    for _ in range(1500):
        shape = tuple(rng.randint(1, 6) for _d in range(rng.randint(1, 3)))
        boxes: list = []
        _guillotine(rng, [0] * len(shape), list(shape), boxes, depth=8)
        rng.shuffle(boxes)
        valid += _check_against_counts(shape, boxes)
        damaged += not _check_against_counts(shape, _damaged(rng, shape, boxes))
    assert valid == 1500 and damaged > 700
    shape, boxes = _pinwheel()
    assert _check_against_counts(shape, boxes)
    for i in range(len(boxes)):
        assert not _check_against_counts(shape, boxes[:i] + boxes[i + 1:])


def test_zero_dim_empty_and_duplicate_boxes():
    assert tiling_fault((), [((), ())]) is None
    assert tiling_fault((), [((), ()), ((), ())]).kind == "overlap"
    assert tiling_fault((), []).kind == "gap"
    assert tiling_fault((0, 4), []) is None  # nothing to hold
    assert tiling_fault((2, 2), [((0, 0), (2, 2)), ((1, 1), (0, 1))]) is None  # empty box
    fault = tiling_fault((2, 2), [((0, 0), (2, 2)), ((0, 0), (2, 2))])
    assert (fault.kind, fault.first, fault.second, fault.point) == ("overlap", 0, 1, (0, 0))
    assert tiling_fault((2,), [((0, 0), (2, 2))]).kind == "dims"


# -- the bound on metadata.json ------------------------------------------------------------

def test_metadata_over_the_bound_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "ck", (2, 3), grid(1, 1))
    size = (tmp_path / "ck" / "metadata.json").stat().st_size
    monkeypatch.setenv(MAX_METADATA_VAR, str(size))
    assert read_metadata(tmp_path / "ck")["tensors"]["w"]["shape"] == [2, 3]  # at the bound
    monkeypatch.setenv(MAX_METADATA_VAR, str(size - 1))
    says = rf"metadata.json holds {size} bytes, more than the bound of {size - 1} bytes .*"
    with pytest.raises(CheckpointError, match=says + MAX_METADATA_VAR):
        inspect(tmp_path / "ck")
    monkeypatch.setenv(MAX_METADATA_VAR, "lots")
    with pytest.raises(CheckpointError, match=f"{MAX_METADATA_VAR} must be an integer"):
        read_metadata(tmp_path / "ck")


def test_a_huge_metadata_file_is_not_read(tmp_path, monkeypatch):
    """A sparse 256 MiB metadata.json: refused by its size alone (json.loads never sees it)."""
    write_checkpoint(tmp_path / "ck", (2, 3), grid(1, 1))
    with open(tmp_path / "ck" / "metadata.json", "r+b") as f:
        f.truncate(256 << 20)
    monkeypatch.delenv(MAX_METADATA_VAR, raising=False)

    def no_parse(*args, **kwargs):
        raise AssertionError("the metadata was parsed")

    monkeypatch.setattr(json, "loads", no_parse)
    with pytest.raises(CheckpointError, match=r"holds 268435456 bytes, more than the bound"):
        read_metadata(tmp_path / "ck")
