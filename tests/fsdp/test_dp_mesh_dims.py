"""``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: torch's way to
name the data-parallel dimensions of a full mesh (torchtitan's default call). Shard dimensions
(several are flattened into one) and a replicate dimension (HSDP) give the same gradients and
parameters as the one-process reference; names the mesh lacks, and dimensions of more than one
rank that are not data-parallel, are refused by name."""

import pytest
import torch
from torch import nn

from shardwise import fully_shard
from shardwise.distributed import init_device_mesh
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import assert_rel_close, run_on_ranks

DataParallelMeshDims = pytest.importorskip(
    "torch.distributed.fsdp", reason="this torch has no DataParallelMeshDims"
).__dict__.get("DataParallelMeshDims")
if DataParallelMeshDims is None:
    pytest.skip("this torch has no DataParallelMeshDims", allow_module_level=True)

RTOL = 1e-5
WIDTH = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.head(self.block(x))


LAYOUTS = {  # name: (mesh shape, mesh dim names, shard, replicate, shard group size)
    "shard": ((2,), ("dp_shard",), "dp_shard", None, 2),
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard"), "dp_shard", "dp_replicate", 2),
    "flattened": ((2, 2), ("dp_shard", "cp"), ("dp_shard", "cp"), None, 4),
    "size-one tp": ((2, 1), ("dp_shard", "tp"), "dp_shard", None, 2),
}


def _train(ctx, layout: str) -> int:
    shape, names, shard, replicate, _ = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    torch.manual_seed(0)
    reference, model = Net(), Net()
    model.load_state_dict(reference.state_dict())
    fully_shard(model.block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        xs = torch.randn(ctx.world_size, 4, WIDTH, generator=gen)
        ref_opt.zero_grad()
        opt.zero_grad()
        for x in xs:
            (reference(x).square().mean() / ctx.world_size).backward()
        model(xs[ctx.rank]).square().mean().backward()
        assert_unit_grads(model, reference, f"{layout}, step {step}", RTOL)
        ref_opt.step()
        opt.step()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(),
                                    strict=True):
        assert_rel_close(mine.full_tensor().detach(), theirs.detach(), RTOL, name)
    return model.block[0].weight.to_local().shape[0]  # rows of 8 this rank holds


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_named_data_parallel_dimensions_shard_as_the_reference(layout):
    shape, _, _, _, shard_size = LAYOUTS[layout]
    world = 1
    for size in shape:
        world *= size
    assert run_on_ranks(world, _train, layout) == [8 // shard_size] * world


def _refused(ctx, case: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dims = {"tp of two ranks": DataParallelMeshDims(shard="dp_shard"),
            "unknown name": DataParallelMeshDims(shard="fsdp")}[case]
    try:
        fully_shard(Net(), mesh=mesh, dp_mesh_dims=dims)
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("case, words", [("tp of two ranks", "['tp']"),
                                         ("unknown name", "'fsdp'")])
def test_dimensions_it_cannot_take_are_refused_by_name(case, words):
    for message in run_on_ranks(4, _refused, case):
        assert words in message and "dp_mesh_dims" in message


def _no_mesh(ctx) -> str:
    try:
        fully_shard(Net(), dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    except TypeError as e:
        return str(e)
    return "accepted"


def test_dp_mesh_dims_without_a_mesh_is_refused():
    assert "mesh=" in run_on_ranks(1, _no_mesh)[0]
