"""DTensors on 1D and 2D meshes (Shard / Replicate) saved and loaded into other layouts and world
sizes; replicated chunks written once; export to safetensors and inspect."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shardwise.checkpoint import export_safetensors, inspect, load, save
from shardwise.models import GPT
from tests.checkpoint import strategies as S
from tests.harness import run_on_ranks


def _tensors():
    return {"a": torch.arange(48.0).reshape(8, 6), "b": torch.arange(60.0).reshape(6, 10) * -1,
            "c": torch.arange(35.0).reshape(7, 5) + 0.5}


def _save_2d(ctx, path: str) -> None:
    t = _tensors()
    mesh = init_device_mesh("cpu", (2, 2))
    line = init_device_mesh("cpu", (4,))
    state = {"a": distribute_tensor(t["a"], mesh, [Shard(0), Shard(1)]),
             "b": distribute_tensor(t["b"], mesh, [Replicate(), Shard(1)]),
             "c": distribute_tensor(t["c"], line, [Shard(0)])}  # uneven: 2, 2, 2, 1 rows
    save(state, checkpoint_id=path)


def _load_other(ctx, path: str) -> dict:
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    t = _tensors()
    state = {"a": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
             "b": distribute_tensor(torch.zeros(6, 10), mesh, [Shard(0)]),
             "c": distribute_tensor(torch.zeros(7, 5), mesh, [Replicate()])}
    load(state, checkpoint_id=path)
    return {k: bool(torch.equal(v.full_tensor(), t[k])) for k, v in state.items()}


def test_2d_mesh_saved_loaded_into_1d_and_plain(tmp_path):
    path = str(tmp_path / "dt")
    run_on_ranks(4, _save_2d, path)
    for ok in run_on_ranks(2, _load_other, path):
        assert ok == {"a": True, "b": True, "c": True}
    plain = {k: torch.zeros_like(v) for k, v in _tensors().items()}
    load(plain, checkpoint_id=path)
    for k, v in _tensors().items():
        assert torch.equal(plain[k], v), k
    info = inspect(path)["tensors"]
    assert len(info["a"]["chunks"]) == 4
    b_chunks = info["b"]["chunks"]  # replicated over mesh dim 0: ranks 0 and 1 write it
    assert sorted(c["file"] for c in b_chunks) == ["rank_00000.bin", "rank_00001.bin"]
    assert sorted(tuple(c["offsets"]) for c in b_chunks) == [(0, 0), (0, 5)]
    assert [c["sizes"][0] for c in info["c"]["chunks"]] == [2, 2, 2, 1]


def test_export_safetensors_loads_into_plain_model(tmp_path):
    path = tmp_path / "fsdp"
    full = run_on_ranks(2, S.train_and_save, "fsdp", str(path), 2)[0]
    out = tmp_path / "model.safetensors"
    names = export_safetensors(path, out)
    loaded = load_file(str(out))
    model = GPT(S.CFG)
    assert sorted(names) == sorted(model.state_dict())
    model.load_state_dict(loaded, strict=True)
    for name, value in loaded.items():
        assert torch.equal(value, full[f"model.{name}"]), name
    info = inspect(path)
    chunks = info["tensors"]["model.blocks.0.mlp.fc1.weight"]["chunks"]
    assert sorted((c["file"], c["offsets"][0]) for c in chunks) == [
        ("rank_00000.bin", 0), ("rank_00001.bin", 32)]
    assert info["values"]["step"] == 2
