"""Process groups, device meshes, timeouts, the local launcher, collective helpers and
communication counting.

This layer knows nothing of the mechanisms above it (DDP, ZeRO, FSDP, ...).
"""

from shardwise.distributed.comm_counter import CommCounter, CommStats
from shardwise.distributed.env import LaunchEnv, launched, read_env
from shardwise.distributed.init import RendezvousTimeout, destroy, init, pick_backend
from shardwise.distributed.launcher import launch
from shardwise.distributed.mesh import DeviceMesh, init_device_mesh
from shardwise.distributed.timeouts import as_timedelta, default_timeout
from shardwise.distributed.topology import InvalidMeshError

__all__ = [
    "CommCounter",
    "CommStats",
    "DeviceMesh",
    "InvalidMeshError",
    "LaunchEnv",
    "RendezvousTimeout",
    "as_timedelta",
    "default_timeout",
    "destroy",
    "init",
    "init_device_mesh",
    "launch",
    "launched",
    "pick_backend",
    "read_env",
]
