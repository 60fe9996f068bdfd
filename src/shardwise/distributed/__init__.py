"""The bottom layer: process groups (``init``), device meshes and their topology, the
environment's readers (env.py), timeouts, collective helpers and communication counting, plus two
small pieces that both the launcher and RPC use (signed store records, private files).

It imports no other shardwise package: not the launcher (``shardwise.launch``, which starts ranks
and imports this one) and no mechanism (DDP, ZeRO, FSDP, RPC, ...); tests/test_layering.py checks.
"""

from shardwise.distributed.comm_counter import CommCounter, CommStats
from shardwise.distributed.env import LaunchEnv, launched, read_env
from shardwise.distributed.init import RendezvousTimeout, destroy, init, pick_backend
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
    "launched",
    "pick_backend",
    "read_env",
]
