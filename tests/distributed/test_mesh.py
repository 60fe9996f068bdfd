"""init_device_mesh on a gloo world of 1, 2 and 4 ranks: torch's DeviceMesh, our groups.

Each check reads the groups back by communicating: an all_gather of the global ranks in each
dimension's group must give exactly the ranks that the pure rank-order rules name.
"""

import io
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shardwise.distributed import DeviceMesh, InvalidMeshError, init_device_mesh
from shardwise.distributed.topology import coordinate, group_of, mesh_ranks
from shardwise.launch import launch
from tests.harness import WORLD_SIZES, procs, run_on_ranks

SCRIPTS = Path(__file__).parent / "scripts"


def _shapes(world):
    """1D and every 2D factorisation of ``world``: (4,), (1, 4), (2, 2), (4, 1) at 4."""
    return [(world,)] + [(a, world // a) for a in range(1, world + 1) if world % a == 0]


def _members(group):
    """The global ranks in ``group``, learnt by an all_gather over it."""
    me = torch.tensor([dist.get_rank()])
    out = [torch.zeros_like(me) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, me, group=group)
    return tuple(int(t) for t in out)


def _release(mesh):
    """Destroy the mesh's own groups (never the world) so that the pool's long-lived ranks do
    not pile up a group per test."""
    for group in {id(g): g for g in mesh.get_all_groups()}.values():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


class _CountNewGroup:
    """Counts dist.new_group calls while active (mesh.py calls it through the module)."""

    def __enter__(self):
        self.calls, self._orig = 0, dist.new_group

        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.new_group = counting
        return self

    def __exit__(self, *exc):
        dist.new_group = self._orig


def _groups_body(ctx, shape, names):
    with _CountNewGroup() as created:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    seen = {"created": created.calls, "is_torch": type(mesh) is DeviceMesh,
            "ndim": mesh.ndim, "shape": tuple(mesh.shape), "device_type": mesh.device_type,
            "names": mesh.mesh_dim_names, "rank": mesh.get_rank(), "mesh": mesh.mesh.tolist(),
            "coordinate": tuple(mesh.get_coordinate()), "dims": []}
    for d in range(len(shape)):
        key = names[d] if names else d
        group = mesh.get_group(key)
        seen["dims"].append({"members": _members(group), "size": mesh.size(d),
                             "local_rank": mesh.get_local_rank(key),
                             "same_by_index": group is mesh.get_group(d)})
    _release(mesh)
    return seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("named", (True, False))
def test_groups_along_each_dim_hold_the_row_major_ranks(world_size, named):
    for shape in _shapes(world_size):
        names = ("dp", "tp")[: len(shape)] if named else None
        results = run_on_ranks(world_size, _groups_body, shape, names)
        # each dimension's groups created once; a dimension spanning the world reuses it
        expected_new = sum(world_size // s for s in shape if s != world_size)
        for rank, seen in enumerate(results):
            assert seen["is_torch"] and seen["ndim"] == len(shape) and seen["shape"] == shape
            assert seen["device_type"] == "cpu" and seen["names"] == names
            assert seen["rank"] == rank and seen["mesh"] == mesh_ranks(shape)
            assert seen["coordinate"] == coordinate(rank, shape)
            assert seen["created"] == expected_new, (shape, seen["created"])
            for d, dim in enumerate(seen["dims"]):
                assert dim["members"] == group_of(rank, shape, d), (shape, d, rank)
                assert dim["size"] == shape[d]
                assert dim["local_rank"] == coordinate(rank, shape)[d]
                assert dim["same_by_index"]


def _slicing_body(ctx, shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    with _CountNewGroup() as created:
        dp, tp, dp_tp = mesh["dp"], mesh["tp"], mesh["dp", "tp"]
        whole = mesh["pp", "dp", "tp"]
    seen = {"created": created.calls, "whole_is_mesh": whole is mesh,
            "dp": (dp.ndim, dp.mesh_dim_names, dp.mesh.tolist(), _members(dp.get_group())),
            "tp": (tp.ndim, tp.mesh.tolist(), tp.get_group() is mesh.get_group("tp")),
            "dp_tp": (dp_tp.ndim, dp_tp.mesh_dim_names, dp_tp.mesh.tolist(),
                      _members(dp_tp.get_group("dp")), _members(dp_tp.get_group("tp"))),
            "dp_local": dp.get_local_rank()}
    _release(mesh)
    return seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_submeshes_reuse_the_groups_of_their_dims(world_size):
    shape = (1, 2, 2) if world_size == 4 else (1, world_size, 1)
    for rank, seen in enumerate(run_on_ranks(world_size, _slicing_body, shape)):
        assert seen["created"] == 0 and seen["whole_is_mesh"]
        dp_group, tp_group = group_of(rank, shape, 1), group_of(rank, shape, 2)
        assert seen["dp"] == (1, ("dp",), list(dp_group), dp_group)
        assert seen["tp"] == (1, list(tp_group), True)
        plane = [list(row) for row in torch.tensor(mesh_ranks(shape))[0].tolist()]
        assert seen["dp_tp"] == (2, ("dp", "tp"), plane, dp_group, tp_group)
        assert seen["dp_local"] == coordinate(rank, shape)[1]


def _dtensor_body(ctx, shape, placements):
    torch.manual_seed(0)  # the same full tensor on every rank
    full = torch.randn(8, 12)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[: len(shape)])
    dt = distribute_tensor(full, mesh, placements)
    result = dt.full_tensor(), dt.to_local(), full
    _release(mesh)
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_dtensor_on_our_mesh_rebuilds_its_input(world_size):
    cases = [((world_size,), [Shard(0)]), ((world_size,), [Shard(1)]),
             (_shapes(world_size)[-1], [Shard(0), Replicate()])]
    if world_size == 4:
        cases.append(((2, 2), [Shard(0), Shard(1)]))
        cases.append(((2, 2), [Shard(1), Shard(1)]))
    for shape, placements in cases:
        results = run_on_ranks(world_size, _dtensor_body, shape, placements)
        for rank, (gathered, local, full) in enumerate(results):
            assert torch.equal(gathered, full), (shape, placements)
            expected = full
            for d, p in enumerate(placements):  # this rank's block, dimension by dimension
                if isinstance(p, Shard):
                    expected = expected.chunk(shape[d], p.dim)[coordinate(rank, shape)[d]]
            assert torch.equal(local, expected), (shape, placements, rank)


def _errors_body(ctx):
    world = ctx.world_size
    caught = {}
    for key, call in {
        "product": lambda: init_device_mesh("cpu", (2, world)),
        "duplicate": lambda: init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "dp")),
        "length": lambda: init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp",)),
        "index": lambda: init_device_mesh("cuda:0", (world,)),
    }.items():
        try:
            call()
        except InvalidMeshError as exc:
            caught[key] = str(exc)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    for key, call in {"slice": lambda: mesh["ep"], "group": lambda: mesh.get_group("ep"),
                      "local": lambda: mesh.get_local_rank("ep")}.items():
        try:
            call()
        except KeyError as exc:
            caught[key] = str(exc)
    _members(mesh.get_group("dp"))  # the world still works after the errors
    _release(mesh)
    return caught


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_shapes_and_names_are_named_errors(world_size):
    for caught in run_on_ranks(world_size, _errors_body):
        assert f"has 2 x {world_size} = {2 * world_size} ranks" in caught["product"]
        assert f"world size is {world_size}" in caught["product"]
        assert "repeats ['dp']" in caught["duplicate"]
        assert "1 names for a mesh of 2" in caught["length"]
        assert "without an index" in caught["index"]
        for key in ("slice", "group", "local"):
            assert "ep" in caught[key] and "dp" in caught[key] and "tp" in caught[key], caught


def test_the_mesh_starts_the_world_group_from_the_launch_environment():
    out, err = io.StringIO(), io.StringIO()
    code = launch(2, [sys.executable, str(SCRIPTS / "mesh_ranks.py")], stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    # LOCAL_WORLD_SIZE=2 on one node: the hybrid mesh is (1, 2); groups along "shard" = {0, 1}
    for rank in range(2):
        assert f"[rank{rank}]: shape=(1, 2) replicate=({rank},) shard=(0, 1)" in lines, lines


def _timeout_of(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _timeout_body(ctx, shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("a", "b"), timeout=7)
    seen = [(_timeout_of(mesh.get_group(d)), mesh.get_group(d) is dist.group.WORLD)
            for d in range(2)]
    _release(mesh)
    return seen


@pytest.mark.parametrize("world_size", (2, 4))
def test_mesh_groups_carry_the_given_timeout_and_a_world_wide_dim_reuses_the_world(world_size):
    for shape in [(world_size, 1), (1, world_size)] + ([(2, 2)] if world_size == 4 else []):
        for dims in run_on_ranks(world_size, _timeout_body, shape):
            for size, (seconds, is_world) in zip(shape, dims):
                assert is_world == (size == world_size)
                if not is_world:
                    assert seconds == 7


def test_the_mesh_starts_the_world_group_under_torchrun():
    cmd = ["-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", "0", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPTS / "mesh_ranks.py")]
    # torchrun started by tests/harness/procs.py (forked from its server); its ranks
    # get OMP_NUM_THREADS=1, as torchrun sets by default
    done = procs.run(cmd, dict(os.environ, OMP_NUM_THREADS="1"), timeout=240)
    report = f"exit code {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    for rank in range(2):  # torchrun sets LOCAL_WORLD_SIZE=2: one node of two ranks
        assert f"shape=(1, 2) replicate=({rank},) shard=(0, 1)" in done.stdout, report
