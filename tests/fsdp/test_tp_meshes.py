"""The FSDP x TP meshes are cached by the process groups they are made over, and an entry goes
with its group: destroying the group drops it (no cache keyed on groups grows without bound)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed.groups import group_alive
from shardwise.fsdp import tp_params
from tests.harness import run_on_ranks


def _destroy_body(ctx):
    dp, tp = dist.new_group([0]), dist.new_group([0])
    dp_mesh, tp_mesh = DeviceMesh.from_group(dp, "cpu"), DeviceMesh.from_group(tp, "cpu")
    mesh = tp_params.mesh_2d(dp_mesh, dp, tp_mesh)
    again = tp_params.mesh_2d(dp_mesh, dp, tp_mesh) is mesh  # one mesh per pair of groups
    before = (dp, tp) in tp_params._MESHES and any(m is mesh for m in tp_params._MESHES.meshes())
    dist.destroy_process_group(dp)
    after = (dp, tp) in tp_params._MESHES or any(m is mesh for m in tp_params._MESHES.meshes())
    alive = group_alive(dp), group_alive(tp)
    dist.destroy_process_group(tp)
    return again, before, after, alive


def test_destroying_a_group_drops_its_meshes():
    [(again, before, after, alive)] = run_on_ranks(1, _destroy_body)
    assert again and before
    assert not after
    assert alive == (False, True)
