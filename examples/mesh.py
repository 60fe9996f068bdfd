"""Device meshes and communication counting, from docs/mesh.md: a 2x2 ("dp", "tp") mesh, the
default hybrid (HSDP) layout from the launcher's variables, and the collectives one backward of
DistributedDataParallel issues, counted per group.

nproc: 4

Checks each rank's coordinates and groups, the hybrid shape on one node, and that the counter
saw the gradient all-reduce.

    shardwise run --nproc 4 examples/mesh.py
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import shardwise
from shardwise.distributed import init


def grid() -> None:
    # block: mesh
    from shardwise.distributed import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # "cuda" on GPUs
    mesh["tp"].get_group()          # this rank's tensor-parallel group
    mesh.get_local_rank("dp")       # this rank's coordinate along "dp"
    print(mesh.size(0), mesh.ndim, mesh.mesh_dim_names, mesh.device_type, mesh.get_rank())
    # block: end
    rank = dist.get_rank()
    tp_ranks = dist.get_process_group_ranks(mesh["tp"].get_group())
    if mesh.get_local_rank("dp") != rank // 2 or tp_ranks != [rank - rank % 2, rank - rank % 2 + 1]:
        raise SystemExit(f"rank {rank}: dp coordinate {mesh.get_local_rank('dp')}, tp group "
                         f"{tp_ranks}")


def hybrid() -> None:
    # block: hybrid
    from shardwise.distributed import init_device_mesh, topology

    world = torch.distributed.get_world_size()
    shape = topology.hybrid_mesh_shape(world, topology.local_world_size_from_env(world))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=topology.HSDP_DIM_NAMES)
    # block: end
    if shape != (1, world) or mesh.mesh_dim_names != ("replicate", "shard"):
        raise SystemExit(f"one node of {world} ranks gave the mesh {shape} "
                         f"{mesh.mesh_dim_names}")


def counting() -> int:
    group = dist.group.WORLD
    torch.manual_seed(0)
    model = shardwise.DistributedDataParallel(torch.nn.Linear(16, 16))
    model.register_comm_hook(group, allreduce_hook)  # gloo's all-reduce (not shared memory)
    x = torch.randn(4, 16)
    # block: comm_counter
    from shardwise.distributed import CommCounter

    with CommCounter(local_world_size=8) as comm:   # default: LOCAL_WORLD_SIZE, else one node
        loss = model(x).sum()
        loss.backward()
    comm.get("all_reduce", group)   # CommStats(calls, bytes, sent_bytes, cross_node_bytes)
    print(comm.table())             # one line per (kind, group)
    # block: end
    stats = comm.get("all_reduce", group)
    if stats.calls < 1 or stats.bytes < 16 * 17 * 4:
        raise SystemExit(f"the gradients' all-reduce was not counted: {stats}")
    return stats.bytes


def main() -> None:
    init()
    grid()
    hybrid()
    reduced = counting()
    if dist.get_rank() == 0:
        print(f"ok: 2x2 mesh coordinates and groups, the hybrid shape on one node, "
              f"{reduced} gradient bytes all-reduced and counted")


if __name__ == "__main__":
    main()
