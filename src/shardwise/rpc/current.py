"""The process's current RPC agent, behind torch.distributed.rpc's module-level functions.

torch's RPC API (``rpc_sync(to, ...)``, ``RRef(value)``) names no agent, so the public API keeps
one per process here. Mechanisms below it (agent, transport, RRef bookkeeping, autograd) take
their agent explicitly; only the public functions read this.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_agent = None


def get_agent():
    agent = _agent
    if agent is None:
        raise RuntimeError("RPC is not initialised in this process; call "
                           "shardwise.rpc.init_rpc(name, rank=..., world_size=...) first")
    return agent


def set_agent(agent) -> None:
    global _agent
    with _lock:
        if agent is not None and _agent is not None:
            raise RuntimeError(f"RPC is already initialised in this process (as "
                               f"{_agent.name!r}); call shutdown() first")
        _agent = agent


def maybe_agent():
    return _agent
