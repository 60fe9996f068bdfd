"""The bottom layer: process groups (``init``), device meshes and their topology, the
environment's readers (env.py), timeouts, collective helpers and communication counting, plus two
small pieces that both the launcher and RPC use (signed store records, private files).

It imports no other shardwise package: not the launcher (``shardwise.launch``, which starts ranks
and imports this one) and no mechanism (DDP, ZeRO, FSDP, RPC, ...); tests/test_layering.py checks.
"""

from shardwise._lazy import lazy_names

_WHERE = {
    "CommCounter": "shardwise.distributed.comm_counter",
    "CommStats": "shardwise.distributed.comm_counter",
    "DeviceMesh": "shardwise.distributed.mesh",
    "InvalidMeshError": "shardwise.distributed.topology",
    "LaunchEnv": "shardwise.distributed.env",
    "RendezvousTimeout": "shardwise.distributed.init",
    "as_timedelta": "shardwise.distributed.timeouts",
    "default_timeout": "shardwise.distributed.timeouts",
    "destroy": "shardwise.distributed.init",
    "init": "shardwise.distributed.init",
    "init_device_mesh": "shardwise.distributed.mesh",
    "launched": "shardwise.distributed.env",
    "pick_backend": "shardwise.distributed.init",
    "read_env": "shardwise.distributed.env",
}
lazy_names(__name__, _WHERE)  # each imported on first use: env readers cost no torch import

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
