"""RPC: rpc_sync / rpc_async / remote, RRefs, device maps, distributed autograd.

Same names and signatures as ``torch.distributed.rpc``; ``shardwise.rpc.autograd`` mirrors
``torch.distributed.autograd``. One agent per process (init_rpc ... shutdown). Layout: agent.py
(requests, serving, shutdown), transport.py / wire.py / auth.py (sockets, frames, handshake),
shm_channel.py / shm_ring.py / shm_pool.py (shared memory between workers on one host),
serialization.py / callables.py (payloads, what peers may name), rref.py / rref_context.py
(references and their counting), device_maps.py / cuda_transfer.py, autograd/, optimizer.py,
functions.py (``async_execution``), remote_module.py (``RemoteModule``, torch's
``torch.distributed.nn.RemoteModule``).
"""

from shardwise.rpc import autograd, functions
from shardwise.rpc.agent import WorkerDied
from shardwise.rpc.api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    set_device_map,
    shutdown,
)
from shardwise.rpc.messages import RemoteException
from shardwise.rpc.optimizer import DistributedOptimizer
from shardwise.rpc.options import (
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)
from shardwise.rpc.remote_module import RemoteModule
from shardwise.rpc.rendezvous import RendezvousError
from shardwise.rpc.rrefs.rref import RRef
from shardwise.rpc.trust.callables import ForbiddenCallable, register, register_module
from shardwise.rpc.wire.device_maps import DeviceMapError

__all__ = [
    "DeviceMapError",
    "DistributedOptimizer",
    "ForbiddenCallable",
    "RRef",
    "RemoteModule",
    "RemoteException",
    "RendezvousError",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerDied",
    "WorkerInfo",
    "autograd",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "register",
    "register_module",
    "remote",
    "rpc_async",
    "rpc_sync",
    "set_device_map",
    "shutdown",
]
