"""Rendezvous through a c10d store: every worker's address and devices.

The store is found as torch's RPC finds it ([Note: shared store]). Every worker publishes
``{name, host, port, devices}`` and reads everyone's record; the group secret never goes
through the store ([Note: group secret] in trust/secret.py). All keys of one ``init_rpc`` live
under their own prefix (``shardwise_rpc/<n>/``, ``n`` counting this process's ``init_rpc``
calls, as torch's ``rpc_prefix_<n>``; ``shardwise_rpc/attempt_<k>/<n>/`` in a launcher's
restarted attempt ``k``, $TORCHELASTIC_RESTART_COUNT, as torch's ranks prefix theirs), so a
store shared with a process group, used by an earlier RPC group of the same processes, or
kept by a launcher from its last attempt, never mixes keys. Every wait is bounded, except the
shutdown barrier's default (see [Note: shutdown] in agent.py).

The records a worker trusts (addresses and barrier arrivals) carry a MAC under the group's key
([Note: signed store records] in distributed/signed_store.py), which holds a job id the workers
agreed on ([Note: group key] in trust/secret.py): a record written without the group secret, or
copied from another group (another job with the same secret, an earlier ``init_rpc``), is
ignored and logged, and the wait goes on for a true one. A worker whose own record was
overwritten while it waits writes it again, so a one-off overwrite delays nobody.

[Note: shared store] ``init_process_group`` then ``init_rpc`` on one MASTER_ADDR / MASTER_PORT
is how DDP and RPC are combined. Without a launcher, rank 0 hosts the TCPStore; two stores
cannot both listen on that port. So: (1) when the default process group's store is a TCPStore
at the same address, RPC uses that store; (2) otherwise rank 0 starts its TCPStore as a
*multi-tenant* server, the one that torch's ``init_process_group`` (env:// and tcp://) also
asks for and that c10d shares between all multi-tenant stores of a process on one port, so a
process group made after RPC reuses it; (3) under torchrun or ``shardwise run``
(TORCHELASTIC_USE_AGENT_STORE) the launcher hosts the store at MASTER_ADDR / MASTER_PORT and
every rank is a client; a store at another address (``tcp://``, in processes that a launched
rank started) is hosted by rank 0, as in (2).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from shardwise._compat import default_store
from shardwise.distributed import signed_store
from shardwise.distributed.env import AGENT_STORE_VAR, flag_var, int_var, is_set, str_var
from shardwise.distributed.groups import global_ranks

PREFIX = "shardwise_rpc"
SCOPE = "shardwise-rpc"  # the signed records' scope (the group key holds the agreed job id)
_init_counter = itertools.count()
_counter_lock = threading.Lock()


class RendezvousError(RuntimeError):
    """The group could not be formed; the message says what was missing or inconsistent."""


def make_store(init_method: str, rank: int, world_size: int, timeout: float) -> dist.Store:
    """The store at ``init_method``'s address ([Note: shared store]): the default process
    group's when it serves that address, else the launcher's (torchrun, ``shardwise run``:
    every rank a client, nothing binds), else one that rank 0 hosts, as ``init_process_group``
    does."""
    host, port = _store_address(init_method)
    shared = default_group_store(host, port)
    if shared is not None:
        return shared
    agent_hosted = launcher_hosts(host, port)
    try:
        return dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_hosted,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False,
                             multi_tenant=True)
    except (RuntimeError, dist.DistError) as exc:
        role = "host" if rank == 0 and not agent_hosted else "reach"
        raise RendezvousError(f"RPC rank {rank}: could not {role} the rendezvous store at "
                              f"{host}:{port} ({type(exc).__name__}: {exc})") from exc


def launcher_hosts(host: str, port: int) -> bool:
    """True when a launcher hosts the store at ``host:port``: it says it hosts one
    (TORCHELASTIC_USE_AGENT_STORE) and that is its address (MASTER_ADDR / MASTER_PORT). A
    process that a launched rank started itself inherits the flag, but the store it was told
    to meet at elsewhere is its own group's, hosted by its rank 0."""
    if not (flag_var(AGENT_STORE_VAR) and is_set("MASTER_ADDR") and is_set("MASTER_PORT")):
        return False
    master_port = int_var("MASTER_PORT", minimum=1, maximum=65535)
    return port == master_port and _same_host(host, str_var("MASTER_ADDR"))


def default_group_store(host: str, port: int) -> dist.Store | None:
    """The default process group's TCPStore (unwrapped from its prefixes) if it serves
    ``host:port``; None when there is no such group or its store lives elsewhere."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = default_store()
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
    process in this launcher attempt; every worker of a group makes the same number of calls,
    as in torch)."""
    with _counter_lock:
        n = next(_init_counter)
    attempt = int_var("TORCHELASTIC_RESTART_COUNT", default=0, minimum=0)
    where = f"{PREFIX}/{n}" if attempt == 0 else f"{PREFIX}/attempt_{attempt}/{n}"
    return dist.PrefixStore(where, store)


def group_store(group: dist.ProcessGroup | None = None) -> dist.Store:
    """The store the default process group rendezvoused through, under a prefix naming
    ``group``'s ranks: an RPC group over the ranks of ``group`` (a pipeline's stages) meets
    there, on any host, and binds no port of its own."""
    if not dist.is_initialized():
        raise RendezvousError("group_store() needs an initialised default process group")
    ranks = global_ranks(group)
    return dist.PrefixStore(f"shardwise_rpc_group/{'_'.join(map(str, ranks))}",
                            default_store())


def _store_address(init_method: str) -> tuple[str, int]:
    if init_method == "env://":
        addr = str_var("MASTER_ADDR")
        if not addr:
            raise RendezvousError("init_method env:// needs MASTER_ADDR and MASTER_PORT in the "
                                  "environment (torchrun and `shardwise run` set them)")
        return addr, int_var("MASTER_PORT", minimum=1, maximum=65535)
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise RendezvousError(f"init_method must be env:// or tcp://host:port, got "
                              f"{init_method!r}")
    return url.hostname, url.port


def advertised_host(store_host: str | None) -> str:
    """The address this worker listens on and peers dial: $SHARDWISE_RPC_ADDR, loopback for a
    loopback store, else the local address of the interface that reaches the store (the one
    the group rendezvoused on; the listener binds there only, never to every interface)."""
    given = str_var("SHARDWISE_RPC_ADDR")
    if given:
        return given
    if store_host is not None:
        try:
            ip = socket.gethostbyname(store_host)
            if ipaddress.ip_address(ip).is_loopback:
                return "127.0.0.1"
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((ip, 9))  # (UDP: picks the route, sends nothing)
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def store_host(store: dist.Store) -> str | None:
    """The host of the TCPStore under ``store``'s prefixes, or None for another kind."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "host", None) if isinstance(store, dist.TCPStore) else None


def exchange(store: dist.Store, rank: int, world_size: int, record: dict,
             timeout: float, key: bytes) -> list[dict]:
    """Publish this worker's record (signed with the group ``key``) and return every worker's
    true record, ordered by rank."""
    mine = (f"worker/{rank}", json.dumps(record))
    signed_store.put(store, *mine, key, SCOPE)
    keys = [f"worker/{r}" for r in range(world_size)]
    values = _wait_records(store, keys, timeout, "publish its address", key, mine)
    try:
        records = [json.loads(v) for v in values]
    except ValueError as exc:  # (signed, so written by a member: a bug, not an attack)
        raise RendezvousError(f"a worker's address record is not JSON: {exc}") from exc
    names = [r["name"] for r in records]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RendezvousError(f"worker names must be unique; {dupes} used more than once")
    return records


def _wait_records(store: dist.Store, keys: list[str], timeout: float, what: str, key: bytes,
                  mine: tuple[str, str]) -> list[bytes]:
    """The values of the true records under ``keys``, waiting up to ``timeout`` seconds;
    ``mine`` is written again whenever it no longer holds."""
    deadline = time.monotonic() + timeout
    values: dict[str, bytes] = {}
    while True:
        for k in keys:
            if k not in values:
                value = signed_store.get(store, k, key, SCOPE)
                if value is not None:
                    values[k] = value
        _keep(store, mine, key)
        if len(values) == len(keys):
            return [values[k] for k in keys]
        if time.monotonic() > deadline:
            missing = [k for k in keys if k not in values]
            forged = [int(k.rsplit("/", 1)[-1]) for k in missing if store.check([k])]
            ranks = [int(k.rsplit("/", 1)[-1]) for k in missing]
            raise RendezvousError(
                f"ranks {ranks} did not {what} within {timeout:.0f} s" +
                (f" (the records of ranks {forged} fail their MAC: written without the group "
                 "secret)" if forged else ""))
        time.sleep(0.005)


def _keep(store: dist.Store, mine: tuple[str, str] | None, key: bytes) -> None:
    """Write this worker's own record again if it no longer holds (overwritten)."""
    if mine is not None and not signed_store.check(store, mine[0], key, SCOPE):
        signed_store.put(store, *mine, key, SCOPE)


def arrive(store: dist.Store, name: str, rank: int, key: bytes) -> None:
    """Mark this rank at barrier ``name`` (a signed record) without waiting."""
    signed_store.put(store, f"{name}/{rank}", "1", key, SCOPE)


def barrier(store: dist.Store, name: str, rank: int, world_size: int, timeout: float | None,
            key: bytes, dead: Callable[[], set[int]] = set,
            keep: tuple[str, ...] = (), told: Callable[[], set[int]] = set) -> list[int]:
    """Mark this rank at barrier ``name`` and wait until every other rank has arrived (a
    true record under the group ``key``, or in ``told()``: ranks that said so over their
    authenticated connection) or is ``dead()``, or ``timeout`` seconds passed (None: no
    limit). Meanwhile this rank's arrival, and its arrivals at the earlier barriers ``keep``,
    are written again whenever they were overwritten (others may still read them).

    Returns the ranks that never arrived (empty when all did): dead ones, or any on timeout.
    """
    mine = [(f"{b}/{rank}", "1") for b in (name, *keep)]
    signed_store.put(store, *mine[0], key, SCOPE)
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.002
    arrived: set[int] = {rank}
    while True:
        gone = dead()  # read before the keys: a rank dead now cannot arrive later
        arrived |= {r for r in told() if 0 <= r < world_size}
        arrived |= {r for r in range(world_size) if r not in arrived
                    and signed_store.check(store, f"{name}/{r}", key, SCOPE)}
        waiting = [r for r in range(world_size) if r not in arrived]
        for record in mine:
            _keep(store, record, key)
        if all(r in gone for r in waiting):
            return waiting
        if deadline is not None and time.monotonic() > deadline:
            return waiting
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)  # shutdown may wait for minutes: poll the store gently
