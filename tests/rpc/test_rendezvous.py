"""Rendezvous pieces without processes: the barrier's answers, store sharing, device names."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardwise.rpc import rendezvous
from shardwise.rpc.remote_module import parse_remote_device

KEY = b"g" * 32


def _arrive(store, name: str, ranks) -> None:
    for r in ranks:
        rendezvous.arrive(store, name, r, KEY)


def test_barrier_all_arrived():
    store = dist.HashStore()
    _arrive(store, "b", [1, 2])
    assert rendezvous.barrier(store, "b", 0, 3, timeout=None, key=KEY) == []


def test_barrier_stops_for_dead_ranks_that_never_arrived_even_without_a_limit():
    store = dist.HashStore()
    _arrive(store, "b", [1])  # rank 1 arrived (and may die afterwards: not an error)
    assert rendezvous.barrier(store, "b", 0, 4, timeout=None, key=KEY,
                              dead=lambda: {1, 2, 3}) == [2, 3]


def test_barrier_limit_names_live_ranks_still_missing():
    store = dist.HashStore()
    assert rendezvous.barrier(store, "b", 0, 3, timeout=0.05, key=KEY, dead=lambda: {2}) == [1, 2]


def test_each_init_gets_its_own_key_prefix():
    store = dist.HashStore()
    first, second = rendezvous.scoped(store), rendezvous.scoped(store)
    first.set("token/0", b"a")
    assert not second.check(["token/0"])


def test_store_is_shared_with_a_multi_tenant_server_on_the_same_port():
    # what torch's init_process_group (env://, tcp://) hosts on rank 0
    group_store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, multi_tenant=True,
                                wait_for_workers=False, timeout=timedelta(seconds=10))
    ours = rendezvous.make_store(f"tcp://127.0.0.1:{group_store.port}", 0, 2, 10.0)
    ours.set("k", b"v")
    assert group_store.get("k") == b"v"


def test_no_default_group_store_without_a_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this test process")
    assert rendezvous.default_group_store("127.0.0.1", 1234) is None


@pytest.mark.parametrize("text, want", [
    ("worker1/cpu", ("worker1", torch.device("cpu"))),
    ("worker1", ("worker1", torch.device("cpu"))),
    ("rank:2/cuda:1", (2, torch.device("cuda:1"))),
])
def test_remote_device_names(text, want):
    assert parse_remote_device(text) == want


@pytest.mark.parametrize("text, match", [
    ("cuda:0", "names a device but no worker"), ("/cpu", "names no worker"),
    ("rank:x/cpu", "bad rank"), ("a/b/c", "must look like"), ("w/nodevice", "bad device"),
])
def test_bad_remote_device_names(text, match):
    with pytest.raises(ValueError, match=match):
        parse_remote_device(text)
