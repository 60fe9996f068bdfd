"""Which store ``init_rpc`` meets at under a launcher's environment: the launcher's at its own
MASTER_ADDR / MASTER_PORT (every rank a client), but rank 0's own at any other address, as in a
process that a launched rank started itself and that inherited TORCHELASTIC_USE_AGENT_STORE
(before, every rank of such a group was a client and the group waited on a store nobody
hosted, until the timeout)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from shardwise.rpc import rendezvous


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launcher(monkeypatch):
    """A stand-in launcher: a store it hosts, announced in the environment as torchrun does."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


def test_a_group_at_another_address_is_hosted_by_its_rank_0(launcher):
    port = _free_port()
    assert not rendezvous.launcher_hosts("127.0.0.1", port)
    store = rendezvous.make_store(f"tcp://127.0.0.1:{port}", 0, 1, timeout=5)
    store.set("k", "v")
    assert store.port == port and store.get("k") == b"v"


def test_the_launchers_address_is_the_launchers_store(launcher):
    assert rendezvous.launcher_hosts("127.0.0.1", launcher.port)
    for init_method in ("env://", f"tcp://127.0.0.1:{launcher.port}"):
        store = rendezvous.make_store(init_method, 0, 2, timeout=5)  # a client: nothing binds
        store.set(f"from {init_method}", "1")
        assert launcher.get(f"from {init_method}") == b"1"


def test_without_a_launcher_nothing_is_the_launchers(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not rendezvous.launcher_hosts("127.0.0.1", 29500)
