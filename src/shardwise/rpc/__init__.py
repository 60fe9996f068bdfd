"""RPC: rpc_sync / rpc_async / remote, RRefs, device maps, distributed autograd.

Same names and signatures as ``torch.distributed.rpc``; ``shardwise.rpc.autograd`` mirrors
``torch.distributed.autograd``. One agent per process (init_rpc ... shutdown). Three parts:
the wire (wire/: sockets, frames, handshake, session MAC, the shared-memory channel, device
maps), trust (trust/: the allow-list, methods of owned values, serialization and its unpickler
checks, the group key), and here the API with the agent: api.py (the torch-named functions),
agent.py (requests, serving, shutdown), pending.py (calls awaiting replies), workers.py (the
pool that runs calls), messages.py, options.py, rendezvous.py, current.py, rrefs/ (references
and their counting), autograd/, optimizer.py, functions.py (``async_execution``),
remote_module.py (``RemoteModule``, torch's ``torch.distributed.nn.RemoteModule``).
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
