"""Rendezvous through a c10d TCPStore: the group token, every worker's address and devices.

Rank 0 hosts the store (``env://`` reads MASTER_ADDR / MASTER_PORT exactly as torchrun sets
them; ``tcp://host:port`` names it directly), writes a fresh random token for authentication
(auth.py), and every worker publishes ``{name, host, port, devices}``. Each worker then reads
everyone's record. Every wait is bounded by the store's timeout.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from shardwise.rpc.auth import new_token

PREFIX = "shardwise_rpc/"


class RendezvousError(RuntimeError):
    """The group could not be formed; the message says what was missing or inconsistent."""


def make_store(init_method: str, rank: int, world_size: int, timeout: float) -> dist.Store:
    host, port = _store_address(init_method)
    return dist.TCPStore(host, port, world_size, is_master=rank == 0,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _store_address(init_method: str) -> tuple[str, int]:
    if init_method == "env://":
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise RendezvousError("init_method env:// needs MASTER_ADDR and MASTER_PORT in the "
                                  "environment (torchrun sets them)")
        return addr, int(port)
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


def share_token(store: dist.Store, rank: int) -> bytes:
    if rank == 0:
        store.set(PREFIX + "token", new_token())
    return bytes(store.get(PREFIX + "token"))


def exchange(store: dist.Store, rank: int, world_size: int, record: dict,
             timeout: float) -> list[dict]:
    """Publish this worker's record and return every worker's, ordered by rank."""
    store.set(f"{PREFIX}worker/{rank}", json.dumps(record))
    keys = [f"{PREFIX}worker/{r}" for r in range(world_size)]
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
            missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
            raise RendezvousError(f"ranks {missing} did not {what} within {timeout:.0f} s")
        time.sleep(0.005)


def barrier(store: dist.Store, name: str, rank: int, world_size: int, timeout: float,
            skip: Callable[[], set[int]] = set) -> list[int]:
    """Mark this rank at barrier ``name`` and wait for the others (but ``skip()``), bounded.

    Returns the ranks that never arrived (empty when all did).
    """
    store.set(f"{PREFIX}{name}/{rank}", "1")
    deadline = time.monotonic() + timeout
    while True:
        gone = skip()
        waiting = [r for r in range(world_size)
                   if r not in gone and not store.check([f"{PREFIX}{name}/{r}"])]
        if not waiting or time.monotonic() > deadline:
            return waiting
        time.sleep(0.005)
