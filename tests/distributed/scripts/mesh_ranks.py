"""A hybrid mesh built straight from the launch environment (no init call before it); each
rank prints the ranks in its group along each dimension, learnt by an all_gather."""

import torch
import torch.distributed as dist

from shardwise.distributed import destroy, init_device_mesh
from shardwise.distributed.topology import (
    HSDP_DIM_NAMES,
    hybrid_mesh_shape,
    local_world_size_from_env,
)


def members(group):
    out = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([float(dist.get_rank())]), group=group)
    return tuple(int(t) for t in out)


world = int(__import__("os").environ["WORLD_SIZE"])
shape = hybrid_mesh_shape(world, local_world_size_from_env(world))
mesh = init_device_mesh("cpu", shape, mesh_dim_names=HSDP_DIM_NAMES)
print(f"shape={tuple(mesh.shape)} replicate={members(mesh.get_group('replicate'))} "
      f"shard={members(mesh.get_group('shard'))}", flush=True)
dist.barrier()  # leave together: rank 0 hosts the store the others still use
destroy()
