"""RRef API, RRefs as arguments and results, and distributed reference counting."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.current import get_agent
from tests.rpc import helpers


def _flush_deletes() -> None:
    gc.collect()
    assert get_agent().rrefs.flush(10.0)


def _live(worker: str) -> int:
    return rpc.rpc_sync(worker, helpers.live_tracked)


def test_rref_api(rpc_world):
    rref = rpc.remote("worker1", helpers.Tracked, args=(torch.arange(3),))
    assert not rref.is_owner()
    assert rref.owner() == rpc.get_worker_info("worker1") and rref.owner_name() == "worker1"
    assert torch.equal(rref.rpc_sync().get(), torch.arange(3))
    assert torch.equal(rref.rpc_sync().add(torch.ones(3), times=2), torch.arange(3) + 2)
    assert torch.equal(rref.rpc_async().add(1).wait(), torch.arange(3) + 1)
    derived = rref.remote().add(10)
    assert derived.owner_name() == "worker1" and torch.equal(derived.to_here(),
                                                             torch.arange(3) + 10)
    with pytest.raises(RuntimeError, match="local_value"):
        rref.local_value()
    mine = rpc.RRef(torch.ones(2))
    assert mine.is_owner() and torch.equal(mine.local_value(), torch.ones(2))
    assert torch.equal(mine.to_here(), torch.ones(2))


def test_rrefs_as_arguments_and_results(rpc_world):
    mine = rpc.RRef(torch.full((2,), 7.0))
    # a user on worker1 fetches from us, the owner
    assert torch.equal(rpc.rpc_sync("worker1", helpers.rref_value, args=(mine,)),
                       torch.full((2,), 7.0))
    # an RRef made on worker2 comes back as a result: we are a user of it
    theirs = rpc.rpc_sync("worker2", helpers.make_rref, args=(5,))
    assert theirs.owner_name() == "worker2" and not theirs.is_owner()
    assert theirs.to_here().value == 5
    # sent back to its owner it is the owner's own reference again
    assert rpc.rpc_sync("worker2", helpers.is_owner_here, args=(theirs,))
    # and to a third worker it is a user reference there
    assert not rpc.rpc_sync("worker1", helpers.is_owner_here, args=(theirs,))


def test_owner_frees_value_when_last_user_drops_it(rpc_world):
    _flush_deletes()
    base = _live("worker1")
    rref = rpc.remote("worker1", helpers.Tracked, args=(1,))
    rref.to_here()  # created
    assert _live("worker1") == base + 1
    del rref
    _flush_deletes()
    assert _live("worker1") == base


def test_fork_to_third_worker_keeps_value_until_every_user_drops(rpc_world):
    _flush_deletes()
    base, owned = _live("worker1"), rpc.rpc_sync("worker1", helpers.owned_count)
    rref = rpc.remote("worker1", helpers.Tracked, args=(2,))
    assert rpc.rpc_sync("worker2", helpers.hold, args=(rref,)) == "worker1"  # fork to worker2
    del rref
    _flush_deletes()
    assert _live("worker1") == base + 1  # worker2 still holds a reference
    assert rpc.rpc_sync("worker2", helpers.fetch_held, args=(0,)).value == 2
    rpc.rpc_sync("worker2", helpers.drop_held)
    assert _live("worker1") == base
    assert rpc.rpc_sync("worker1", helpers.owned_count) == owned


def test_user_forks_its_reference_onwards(rpc_world):
    """worker0 (user) -> worker2 (user) -> worker0 again, owner worker1; all drop, owner frees."""
    _flush_deletes()
    base = _live("worker1")
    rref = rpc.remote("worker1", helpers.Tracked, args=(3,))
    rpc.rpc_sync("worker2", helpers.hold, args=(rref,))
    rpc.rpc_sync("worker2", helpers.pass_on_held, args=(0, "worker0"))
    del rref
    _flush_deletes()
    rpc.rpc_sync("worker2", helpers.drop_held)
    assert _live("worker1") == base + 1  # worker0 holds the fork that worker2 passed it
    assert helpers._held[0].to_here().value == 3
    helpers.drop_held()
    deadline = time.monotonic() + 10
    while _live("worker1") != base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _live("worker1") == base


def test_owner_local_reference_outlives_forks(rpc_world):
    """An owner's own RRef keeps the value alive after every user fork is gone."""
    _flush_deletes()
    rref = rpc.rpc_sync("worker1", helpers.make_and_keep, args=(4,))
    base_after = _live("worker1")
    del rref
    _flush_deletes()
    assert _live("worker1") == base_after  # worker1 still holds its owner reference
    rpc.rpc_sync("worker1", helpers.drop_kept)
    assert _live("worker1") == base_after - 1
