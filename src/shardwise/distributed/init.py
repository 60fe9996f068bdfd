"""Starting and ending the default process group.

``init`` works under torchrun (it reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), under our own
launcher, or from an explicit rank and world size. It picks gloo for CPU and NCCL for CUDA, gives
the group a timeout, and checks that every rank joined before returning: a missing rank becomes a
``RendezvousTimeout`` that names the ranks that never arrived, instead of a hang.
"""

from __future__ import annotations

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.distributed.env import LaunchEnv, launched, read_env
from shardwise.distributed.timeouts import as_timedelta

_JOIN_PREFIX = "shardwise/joined/"


class RendezvousTimeout(RuntimeError):
    """Not every rank reached the rendezvous within the timeout."""


def pick_backend(device: str | torch.device | None = None) -> str:
    """``nccl`` when the ranks compute on CUDA, ``gloo`` otherwise."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float | timedelta | None = None,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Create the default (world) process group and return it.

    With no arguments, the launch environment is read. The store is a TCPStore hosted by rank 0,
    or by the launcher when it says so (as torchrun's agent does). Every rank then announces
    itself in the store and waits for the others, so a rank that never starts is reported by
    rank number after ``timeout`` seconds.
    """
    if dist.is_initialized():
        raise RuntimeError("shardwise.distributed.init: the default process group already exists")
    timeout = as_timedelta(timeout)
    env = _resolve_env(rank, world_size, master_addr, master_port, store is not None)
    backend = backend or pick_backend()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
    if store is None:
        store = _make_store(env, timeout)
    store = dist.PrefixStore(f"shardwise/attempt_{env.restart_count}/", store)
    _wait_for_peers(store, env.rank, env.world_size, timeout)
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    # A process that exits with its group alive dies in c10d's destructors ("terminate called
    # without an active exception", SIGABRT): tear the group down at exit if the script did not.
    atexit.register(destroy)
    return dist.group.WORLD


def destroy() -> None:
    """Tear down the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _resolve_env(
    rank: int | None, world_size: int | None, addr: str | None, port: int | None, has_store: bool
) -> LaunchEnv:
    if rank is None and world_size is None and launched():
        env = read_env()
        if addr is None and port is None:
            return env
        return LaunchEnv(env.rank, env.world_size, env.local_rank, addr or env.master_addr,
                         port or env.master_port, env.agent_store, env.restart_count)
    if rank is None or world_size is None:
        raise ValueError("pass both rank and world_size, or neither (to read torchrun's env)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if port is None and not has_store:
        raise ValueError("pass master_port (or a store) when rank and world_size are explicit")
    return LaunchEnv(rank, world_size, rank, addr or "127.0.0.1", port or 0, False, 0)


def _make_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    is_master = env.rank == 0 and not env.agent_store
    try:
        return dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=is_master,
            timeout=timeout, wait_for_workers=False, multi_tenant=True,  # RPC may share it
        )
    except (RuntimeError, dist.DistError) as exc:
        where = f"{env.master_addr}:{env.master_port}"
        role = "host" if is_master else "reach"
        raise RendezvousTimeout(
            f"rank {env.rank}: could not {role} the rendezvous store at {where} within "
            f"{timeout.total_seconds():g} s ({exc.__class__.__name__}: {exc})"
        ) from exc


def _wait_for_peers(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    store.set(f"{_JOIN_PREFIX}{rank}", "1")
    keys = [f"{_JOIN_PREFIX}{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except (RuntimeError, dist.DistError) as exc:
        missing = _missing_ranks(store, keys)
        raise RendezvousTimeout(
            f"rank {rank}: only {world_size - len(missing)} of {world_size} ranks joined within "
            f"{timeout.total_seconds():g} s; missing ranks: {missing}"
        ) from exc


def _missing_ranks(store: dist.Store, keys: list[str]) -> list[int]:
    try:
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except (RuntimeError, dist.DistError):
        return list(range(len(keys)))  # the store itself went away
