"""Rendezvous through a c10d store: the group token, every worker's address and devices.

The store is found as torch's RPC finds it ([Note: shared store]). Rank 0 writes a fresh random
token for authentication (auth.py), and every worker publishes ``{name, host, port, devices}``
and reads everyone's record. All keys of one ``init_rpc`` live under their own prefix
(``shardwise_rpc/<n>/``, ``n`` counting this process's ``init_rpc`` calls, as torch's
``rpc_prefix_<n>``), so a store shared with a process group, or used by an earlier RPC group of
the same processes, never mixes keys. Every wait is bounded, except the shutdown barrier's
default (see [Note: shutdown] in agent.py).

[Note: shared store] ``init_process_group`` then ``init_rpc`` on one MASTER_ADDR / MASTER_PORT
is how DDP and RPC are combined. Without a launcher, rank 0 hosts the TCPStore; two stores
cannot both listen on that port. So: (1) when the default process group's store is a TCPStore
at the same address, RPC uses that store; (2) otherwise rank 0 starts its TCPStore as a
*multi-tenant* server, the one that torch's ``init_process_group`` (env:// and tcp://) also
asks for and that c10d shares between all multi-tenant stores of a process on one port, so a
process group made after RPC reuses it; (3) under torchrun or ``shardwise run``
(TORCHELASTIC_USE_AGENT_STORE) the launcher hosts the store and every rank is a client. The
token is still written by rank 0 to the store that every member, and only a member, joined.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from shardwise.distributed.env import flag_var, int_var
from shardwise.rpc.auth import new_token

PREFIX = "shardwise_rpc"
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
_init_counter = itertools.count()
_counter_lock = threading.Lock()


class RendezvousError(RuntimeError):
    """The group could not be formed; the message says what was missing or inconsistent."""


def make_store(init_method: str, rank: int, world_size: int, timeout: float) -> dist.Store:
    """The store at ``init_method``'s address ([Note: shared store])."""
    host, port = _store_address(init_method)
    shared = default_group_store(host, port)
    if shared is not None:
        return shared
    agent_hosted = flag_var(AGENT_STORE_VAR)
    try:
        return dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_hosted,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False,
                             multi_tenant=True)
    except (RuntimeError, dist.DistError) as exc:
        role = "host" if rank == 0 and not agent_hosted else "reach"
        raise RendezvousError(f"RPC rank {rank}: could not {role} the rendezvous store at "
                              f"{host}:{port} ({type(exc).__name__}: {exc})") from exc


def default_group_store(host: str, port: int) -> dist.Store | None:
    """The default process group's TCPStore (unwrapped from its prefixes) if it serves
    ``host:port``; None when there is no such group or its store lives elsewhere."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore) or store.port != port:
        return None
    return store if _same_host(store.host, host) else None


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def scoped(store: dist.Store) -> dist.Store:
    """``store`` seen under this ``init_rpc`` call's own key prefix (the n-th call of the
    process; every worker of a group makes the same number of calls, as in torch)."""
    with _counter_lock:
        n = next(_init_counter)
    return dist.PrefixStore(f"{PREFIX}/{n}", store)


def _store_address(init_method: str) -> tuple[str, int]:
    if init_method == "env://":
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise RendezvousError("init_method env:// needs MASTER_ADDR and MASTER_PORT in the "
                                  "environment (torchrun sets them)")
        return addr, int_var("MASTER_PORT", minimum=1, maximum=65535)
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise RendezvousError(f"init_method must be env:// or tcp://host:port, got "
                              f"{init_method!r}")
    return url.hostname, url.port


def advertised_host(store_host: str | None) -> str:
    """The address peers should dial: $SHARDWISE_RPC_ADDR, loopback for a loopback store, or
    this host's resolved name."""
    if os.environ.get("SHARDWISE_RPC_ADDR"):
        return os.environ["SHARDWISE_RPC_ADDR"]
    if store_host is not None:
        try:
            if ipaddress.ip_address(socket.gethostbyname(store_host)).is_loopback:
                return "127.0.0.1"
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def share_token(store: dist.Store, rank: int, timeout: float) -> bytes:
    """Rank 0 writes a fresh token for this group; every rank reads it (waits ``timeout`` s)."""
    if rank == 0:
        store.set("token/0", new_token())
    else:
        _wait_keys(store, ["token/0"], timeout, "publish the group token")
    return bytes(store.get("token/0"))


def exchange(store: dist.Store, rank: int, world_size: int, record: dict,
             timeout: float) -> list[dict]:
    """Publish this worker's record and return every worker's, ordered by rank."""
    store.set(f"worker/{rank}", json.dumps(record))
    keys = [f"worker/{r}" for r in range(world_size)]
    _wait_keys(store, keys, timeout, "publish its address")
    records = [json.loads(store.get(k)) for k in keys]
    names = [r["name"] for r in records]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RendezvousError(f"worker names must be unique; {dupes} used more than once")
    return records


def _wait_keys(store: dist.Store, keys: list[str], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [int(k.rsplit("/", 1)[-1]) for k in keys if not store.check([k])]
            raise RendezvousError(f"ranks {missing} did not {what} within {timeout:.0f} s")
        time.sleep(0.005)


def barrier(store: dist.Store, name: str, rank: int, world_size: int, timeout: float | None,
            dead: Callable[[], set[int]] = set) -> list[int]:
    """Mark this rank at barrier ``name`` and wait until every other rank has arrived or is
    ``dead()``, or ``timeout`` seconds passed (None: no limit).

    Returns the ranks that never arrived (empty when all did): dead ones, or any on timeout.
    """
    store.set(f"{name}/{rank}", "1")
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.002
    while True:
        gone = dead()  # read before the keys: a rank dead now cannot arrive later
        waiting = [r for r in range(world_size) if not store.check([f"{name}/{r}"])]
        if all(r in gone for r in waiting):
            return waiting
        if deadline is not None and time.monotonic() > deadline:
            return waiting
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)  # shutdown may wait for minutes: poll the store gently
