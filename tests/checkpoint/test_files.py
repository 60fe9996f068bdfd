"""One process: the files a save leaves, and the errors a damaged or mismatched checkpoint
gives (naming the file and the tensor), with no unpickling anywhere."""

from __future__ import annotations

import json
import pickle
import zlib
from unittest import mock

import pytest
import torch

from shardwise.checkpoint import CheckpointError, async_save, inspect, load, save


def _state():
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 70, generator=gen), "b": torch.randn(70, generator=gen),
                      "n": torch.arange(5, dtype=torch.int64), "h": torch.randn(4, generator=gen)
                      .to(torch.bfloat16)},
            "optim": {"step": torch.tensor(7.0), "groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]},
            "epoch": 3, "name": "run-1", "ratio": 0.5, "flags": {"a": True, "b": None}}


def _zeros_like(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"step": torch.tensor(0.0), "groups": []},
            "epoch": 0, "name": "", "ratio": 0.0, "flags": {"a": False, "b": 1}}


def test_round_trip_tensors_and_values(tmp_path):
    state = _state()
    save(state, checkpoint_id=tmp_path / "ck")
    target = _zeros_like(state)
    load(target, checkpoint_id=tmp_path / "ck")
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v) and target["model"][k].dtype == v.dtype
    assert float(target["optim"]["step"]) == 7.0
    assert target["optim"]["groups"] == [{"lr": 0.1, "betas": [0.9, 0.99]}]
    assert (target["epoch"], target["name"], target["ratio"]) == (3, "run-1", 0.5)
    assert target["flags"] == {"a": True, "b": None}


def test_files_are_raw_bytes_and_json(tmp_path):
    state = _state()
    save(state, checkpoint_id=tmp_path / "ck")
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["metadata.json", "rank_00000.bin"]
    assert not (tmp_path / "ck.tmp").exists()
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    rec = meta["tensors"]["model.w"]["chunks"][0]
    raw = (tmp_path / "ck" / "rank_00000.bin").read_bytes()
    body = raw[rec["byte_offset"] : rec["byte_offset"] + rec["nbytes"]]
    assert body == state["model"]["w"].numpy().tobytes()
    assert rec["crc32"][0] == zlib.crc32(body[: rec["block_rows"] * 70 * 4])
    assert meta["values"]["epoch"] == 3 and meta["tensors"]["model.h"]["dtype"] == "bfloat16"
    info = inspect(tmp_path / "ck")
    assert info["tensors"]["model.w"]["shape"] == (300, 70)
    assert info["tensors"]["model.w"]["chunks"][0]["offsets"] == [0, 0]


def test_nothing_unpickles(tmp_path):
    state = _state()
    save(state, checkpoint_id=tmp_path / "ck")
    target = _zeros_like(state)
    boom = mock.Mock(side_effect=AssertionError("unpickling"))
    with mock.patch.object(pickle, "loads", boom), mock.patch.object(pickle, "load", boom), \
            mock.patch.object(pickle, "Unpickler", boom), mock.patch.object(torch, "load", boom):
        load(target, checkpoint_id=tmp_path / "ck")
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_truncated_file_names_file_and_tensor(tmp_path):
    save(_state(), checkpoint_id=tmp_path / "ck")
    data = tmp_path / "ck" / "rank_00000.bin"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"rank_00000\.bin.*tensor model\.\w.*truncated"):
        load(_zeros_like(_state()), checkpoint_id=tmp_path / "ck")


def test_altered_byte_names_file_and_tensor(tmp_path):
    save(_state(), checkpoint_id=tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    at = meta["tensors"]["model.b"]["chunks"][0]["byte_offset"] + 5
    data = tmp_path / "ck" / "rank_00000.bin"
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"rank_00000\.bin is corrupt: tensor model\.b"):
        load(_zeros_like(_state()), checkpoint_id=tmp_path / "ck")


def test_missing_and_incomplete_dirs(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load({}, checkpoint_id=tmp_path / "nope")
    (tmp_path / "half.tmp").mkdir()
    with pytest.raises(CheckpointError, match="incomplete: a save did not finish"):
        load({}, checkpoint_id=tmp_path / "half")
    save(_state(), checkpoint_id=tmp_path / "ck")
    (tmp_path / "ck" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete.*no metadata.json"):
        load({}, checkpoint_id=tmp_path / "ck")


def test_mismatch_lists_names_and_shapes(tmp_path):
    save(_state(), checkpoint_id=tmp_path / "ck")
    target = _zeros_like(_state())
    target["model"]["w"] = torch.zeros(300, 71)
    target["model"]["extra"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as err:
        load(target, checkpoint_id=tmp_path / "ck")
    text = str(err.value)
    assert "missing keys" in text and "'model.extra'" in text
    assert "model.w: checkpoint (300, 70), requested (300, 71)" in text
    small = {"model": {"w": torch.zeros(300, 70)}}
    load(small, checkpoint_id=tmp_path / "ck")  # a subset loads (as torch DCP)
    with pytest.raises(CheckpointError, match=r"unexpected keys .*'model\.b'"):
        load(small, checkpoint_id=tmp_path / "ck", strict=True)


def test_bad_values_rejected_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match="opaque.*neither a tensor nor a JSON value"):
        save({"opaque": object()}, checkpoint_id=tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    with pytest.raises(TypeError, match="unexpected keyword"):
        save({}, checkpoint_id=tmp_path / "x", storage_writer=None)


def test_overwrite_replaces_whole_checkpoint(tmp_path):
    save({"a": torch.ones(3)}, checkpoint_id=tmp_path / "ck")
    save({"a": torch.full((3,), 2.0)}, checkpoint_id=tmp_path / "ck")
    target = {"a": torch.zeros(3)}
    load(target, checkpoint_id=tmp_path / "ck")
    assert target["a"].tolist() == [2.0, 2.0, 2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_async_save_copies_then_writes(tmp_path):
    state = {"w": torch.randn(64, 64)}
    before = state["w"].clone()
    future = async_save(state, checkpoint_id=tmp_path / "ck")
    state["w"].add_(1.0)  # training goes on
    future.result(timeout=60)
    target = {"w": torch.zeros(64, 64)}
    load(target, checkpoint_id=tmp_path / "ck")
    assert torch.equal(target["w"], before)


def test_failed_async_save_raises_on_next_call(tmp_path, monkeypatch):
    def fail(point, index):
        if point == "parts":
            raise OSError("disk full (simulated)")

    future = async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "ck", _fault_hook=fail)
    with pytest.raises(OSError, match="disk full"):
        future.result(timeout=60)
    with pytest.raises(CheckpointError, match="previous async_save failed.*disk full"):
        save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "ck2")
    save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "ck2")  # reported once
    with pytest.raises(CheckpointError, match="incomplete"):
        load({"w": torch.zeros(4)}, checkpoint_id=tmp_path / "ck")
