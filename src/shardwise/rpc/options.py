"""Options of an RPC agent (named like torch's TensorPipeRpcBackendOptions) and WorkerInfo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardwise.rpc.trust.callables import register
from shardwise.rpc.wire.device_maps import DeviceMap, normalize_device_map, normalize_devices
from shardwise.rpc.wire.frames import DEFAULT_MAX_MESSAGE

DEFAULT_RPC_TIMEOUT = 60.0  # seconds, as torch's
DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # torch's: no limit
UNSET_RPC_TIMEOUT = -1.0  # "use the agent's rpc_timeout"; 0 means no timeout (torch's rule)


@register
@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the group: its unique name and its rank (``id``, as in torch)."""

    name: str
    id: int


@dataclass
class TensorPipeRpcBackendOptions:
    """Agent options with torch's names; ``store`` and ``shutdown_timeout`` are ours.

    ``init_method``: ``"env://"`` (MASTER_ADDR / MASTER_PORT, as torchrun sets them) or
    ``"tcp://host:port"``: the c10d TCPStore there, shared with the default process group's
    (see [Note: shared store] in rendezvous.py). ``store``: an existing c10d store to
    rendezvous through instead. ``shutdown_timeout``: the bound of a graceful ``shutdown()``
    that passes no timeout; 0 (default, as torch's): wait as long as the live workers work.
    ``device_maps``: ``{worker_name: {local: remote}}``; ``devices``: the local devices this
    agent may use (default: those the maps name). ``max_message_size``: the largest frame
    (pickle and tensors) this worker accepts from a peer; a larger one drops that connection.
    ``handshake_timeout``: the time a new connection has to authenticate, in all.
    """

    num_worker_threads: int = 16
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    init_method: str = "env://"
    device_maps: dict[str, DeviceMap] = field(default_factory=dict)
    devices: list[Any] | None = None
    store: dist.Store | None = None
    shutdown_timeout: float = 0.0  # seconds; 0: no limit
    connect_timeout: float = 60.0
    max_message_size: int = DEFAULT_MAX_MESSAGE  # bytes per frame received (ours)
    handshake_timeout: float = 10.0  # seconds for a whole incoming handshake (ours)

    def __post_init__(self) -> None:
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        if self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 seconds (0: none), got {self.rpc_timeout}")
        if self.max_message_size < 1:
            raise ValueError(f"max_message_size must be >= 1 byte, got {self.max_message_size}")
        if not self.handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be > 0 seconds, got "
                             f"{self.handshake_timeout}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds (0: none), got "
                             f"{self.shutdown_timeout}")
        self.device_maps = {str(k): normalize_device_map(v)
                            for k, v in (self.device_maps or {}).items()}
        if self.devices is not None:
            self.devices = normalize_devices(self.devices)

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Add ``device_map`` (local device -> device on ``to``) for calls to worker ``to``."""
        merged = dict(self.device_maps.get(to, {}))
        merged.update(normalize_device_map(device_map))
        self.device_maps[to] = merged

    def set_devices(self, devices: list) -> None:
        self.devices = normalize_devices(devices)


RpcBackendOptions = TensorPipeRpcBackendOptions
