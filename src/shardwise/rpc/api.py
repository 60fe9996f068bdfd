"""torch.distributed.rpc's functions: init_rpc, rpc_sync, rpc_async, remote, shutdown, ..."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

from shardwise.distributed.env import int_var, is_set
from shardwise.rpc import current
from shardwise.rpc.agent import start_agent
from shardwise.rpc.messages import Kind
from shardwise.rpc.options import UNSET_RPC_TIMEOUT, TensorPipeRpcBackendOptions, WorkerInfo
from shardwise.rpc.rrefs.rref import RRef
from shardwise.rpc.trust.callables import qualified_name, register_module, set_program_roots
from shardwise.rpc.wire.device_maps import normalize_device_map, validate_device_maps


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: TensorPipeRpcBackendOptions | None = None, *,
             allowed_modules: Iterable[str | ModuleType] = ()) -> None:
    """Join the RPC group as worker ``name``; returns once every worker is connected.

    ``rank`` / ``world_size`` default to $RANK / $WORLD_SIZE (torchrun). ``backend`` is accepted
    for torch's signature; there is one backend. The rendezvous store at MASTER_ADDR /
    MASTER_PORT (or ``tcp://``) is shared with a process group on the same address, made before
    or after this call ([Note: shared store] in rendezvous.py).

    ``allowed_modules`` (ours): modules whose own functions and classes peers may call, beside
    ``__main__`` and what :func:`register` marked ([Note: allow-list] in trust/callables.py).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"worker name must be a non-empty string, got {name!r}")
    rank = int_var("RANK", minimum=0) if rank < 0 and is_set("RANK") else rank
    if world_size is None and is_set("WORLD_SIZE"):
        world_size = int_var("WORLD_SIZE", minimum=1)
    if world_size is None or not 0 <= rank < world_size:
        raise ValueError(f"init_rpc needs 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
    options = rpc_backend_options or TensorPipeRpcBackendOptions()
    for module in allowed_modules:
        register_module(module)
    set_program_roots()  # the script's and this working directory ([Note: allow-list] rule 2)
    if current.maybe_agent() is not None:
        raise RuntimeError(f"RPC is already initialised in this process (as "
                           f"{current.maybe_agent().name!r}); call shutdown() first")
    start_agent(name, rank, world_size, options, publish=current.set_agent)


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Leave the group. ``graceful`` (torch's default): first wait until every worker has
    called ``shutdown()``, serving peers meanwhile; ``timeout`` seconds bound that wait (None:
    the agent's ``shutdown_timeout``; 0: no limit, torch's default). A worker that died before
    calling it is a :class:`WorkerDied` error, raised after this worker has shut down. See
    [Note: shutdown] in agent.py."""
    agent = current.maybe_agent()
    if agent is None:
        return
    try:
        agent.shutdown(graceful, timeout)
    finally:
        current.set_agent(None)


def get_rpc_timeout() -> float:
    """The default timeout of this worker's calls, in seconds (0: none), as torch's."""
    return float(current.get_agent().options.rpc_timeout)


def is_available() -> bool:
    """Whether RPC can be used in this build: always, it needs only sockets and c10d's store."""
    return True


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    agent = current.get_agent()
    return agent.worker(worker_name if worker_name is not None else agent.name)


def rpc_async(to: str | int | WorkerInfo, func: Callable, args: tuple | None = None,
              kwargs: dict | None = None,
              timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Call ``func(*args, **kwargs)`` on ``to``; returns a future of the result."""
    return current.get_agent().call(to, func, args, kwargs, timeout)


def rpc_sync(to: str | int | WorkerInfo, func: Callable, args: tuple | None = None,
             kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on ``to`` and wait for the result (or its exception,
    raised here with the remote traceback)."""
    fut = rpc_async(to, func, args, kwargs, timeout)
    current.get_agent().wait_reply(to, fut)
    return fut.wait()


def remote(to: str | int | WorkerInfo, func: Callable, args: tuple | None = None,
           kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func`` on ``to`` and return an RRef to its result, which stays on ``to``."""
    agent = current.get_agent()
    dest = agent.worker(to).id
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if dest == agent.rank:
        entry = agent.rrefs.new_local(None)
        entry.future = agent.call(dest, func, args, kwargs, timeout)
        return RRef._make(agent, entry.rref_id, dest, entry=entry)
    fname = qualified_name(func)
    rref_id, fork = agent.rrefs.new_id(), agent.rrefs.new_id()
    rref = RRef._make(agent, rref_id, dest, fork=fork)
    rref._created = agent.request(
        dest, Kind.REMOTE, (fname, args, kwargs, agent.reply_map(dest), rref_id, fork),
        agent.timeout_of(timeout), f"remote() on {agent.workers[dest].name!r} ({fname})")
    return rref


def set_device_map(to: str, device_map: dict) -> None:
    """Add ``device_map`` (local -> device on ``to``) to the running agent's maps, checked
    against the devices ``to`` published at init."""
    agent = current.get_agent()
    merged = dict(agent.device_maps.get(to, {}))
    merged.update(normalize_device_map(device_map))
    peers = {w.name: agent.peer_devices[w.id] for w in agent.workers}
    validate_device_maps({to: merged}, agent.peer_devices[agent.rank], peers, agent.name)
    agent.device_maps[to] = merged
