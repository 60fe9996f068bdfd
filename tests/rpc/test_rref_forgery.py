"""RRef ids are capabilities: a peer that never got an RRef cannot fetch, call, fork, delete or
pre-create it, even knowing its id ([Note: RRef ids are capabilities] in rref_context.py).

The victim is worker1, holding an RRef that worker2 owns; the attacker is this process
(worker0), an authenticated member of the group that learnt the victim's ids and crafts raw
requests with its own agent. Every refusal must leave the victim's value and fork intact.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.current import get_agent
from shardwise.rpc.messages import Kind
from shardwise.rpc.rrefs.rref import RRef
from shardwise.rpc.rrefs.rref_context import ForbiddenRRef
from tests.rpc import helpers

OWNER, VICTIM = "worker2", "worker1"


def _forge(kind: Kind, body: tuple, to: str = OWNER):
    """Send a hand-made request from this worker and wait for the reply."""
    agent = get_agent()
    return agent.request(agent.worker(to).id, kind, body, 20.0, f"forged {kind.name}").wait()


def _victim_holds(value: float) -> tuple:
    rref_id, fork = rpc.rpc_sync(VICTIM, helpers.victim_makes, args=(OWNER, value))
    assert torch.equal(rpc.rpc_sync(VICTIM, helpers.victim_reads), torch.full((2,), value))
    return rref_id, fork


def _victim_still_reads(value: float) -> None:
    assert torch.equal(rpc.rpc_sync(VICTIM, helpers.victim_reads), torch.full((2,), value))


@pytest.fixture
def victim(rpc_world):
    yield
    rpc.rpc_sync(VICTIM, helpers.victim_drops)


def test_fetch_of_another_workers_rref_is_refused(victim):
    rref_id, _ = _victim_holds(7.0)
    with pytest.raises(ForbiddenRRef, match="does not hold"):
        _forge(Kind.FETCH, (rref_id,))
    # ids a counter would have given are not there to guess either
    for guess in range(1, 40):
        with pytest.raises(ForbiddenRRef):
            _forge(Kind.FETCH, ((rref_id[0], guess),))
    _victim_still_reads(7.0)


def test_method_call_through_a_forged_id_is_refused(victim):
    rref_id, _ = _victim_holds(7.0)
    forged = RRef._make(get_agent(), rref_id, get_agent().worker(OWNER).id)
    with pytest.raises(ForbiddenRRef, match="does not hold"):
        forged.rpc_sync().fill_(-666.0)
    with pytest.raises(ForbiddenRRef):
        forged.rpc_async().fill_(-666.0).wait()
    _victim_still_reads(7.0)


def test_forged_fork_delete_is_refused_and_the_fork_still_works(victim):
    owned = rpc.rpc_sync(OWNER, helpers.owned_count)
    rref_id, fork = _victim_holds(7.0)
    assert rpc.rpc_sync(OWNER, helpers.owned_count) == owned + 1
    with pytest.raises(ForbiddenRRef, match="does not hold"):
        _forge(Kind.FORK_DEL, (rref_id, fork))
    assert rpc.rpc_sync(OWNER, helpers.owned_count) == owned + 1
    _victim_still_reads(7.0)


def test_ids_precreated_in_another_workers_namespace_are_refused(victim):
    owned = rpc.rpc_sync(OWNER, helpers.owned_count)
    rref_id, fork = _victim_holds(7.0)
    # the ids the victim's next remote() would take if ids counted up
    for step in range(1, 5):
        guess = (rref_id[0], fork[1] + step)
        body = ("torch:full", ((2,), -666.0), {}, None, guess, (rref_id[0], fork[1] + 99))
        with pytest.raises(ForbiddenRRef, match="namespace"):
            _forge(Kind.REMOTE, body)
    assert rpc.rpc_sync(OWNER, helpers.owned_count) == owned + 1
    mine = rpc.rpc_sync(VICTIM, helpers.victim_remote_value, args=(OWNER, 5.0))
    assert torch.equal(mine, torch.full((2,), 5.0))
    _victim_still_reads(7.0)


def test_remote_with_an_id_that_exists_is_refused(rpc_world):
    rref = rpc.remote(OWNER, torch.full, args=((2,), 3.0))
    assert torch.equal(rref.to_here(), torch.full((2,), 3.0))
    me = get_agent().rank
    body = ("torch:full", ((2,), -666.0), {}, None, rref._id, (me, secrets.randbits(128)))
    with pytest.raises(ForbiddenRRef, match="exists"):
        _forge(Kind.REMOTE, body)
    assert torch.equal(rref.to_here(), torch.full((2,), 3.0))


def test_fork_add_of_an_rref_not_held_is_refused(victim):
    """Asking the owner to count a fork (for oneself or a third worker) needs a reference."""
    rref_id, _ = _victim_holds(7.0)
    me = get_agent().rank
    fork = (me, secrets.randbits(128))
    with pytest.raises(ForbiddenRRef, match="does not hold"):
        _forge(Kind.FORK_ADD, (rref_id, fork, me))
    with pytest.raises(ForbiddenRRef):
        _forge(Kind.FETCH, (rref_id,))
    with pytest.raises(ForbiddenRRef):  # a fork made in another worker's name
        _forge(Kind.FORK_ADD, (rref_id, (get_agent().worker(VICTIM).id, 1), me))
    _victim_still_reads(7.0)


@pytest.mark.parametrize("kind, body", [
    (Kind.FETCH, ("not an id",)),
    (Kind.FETCH, ((0, 1, 2),)),
    (Kind.FORK_DEL, ((1, 2),)),
    (Kind.FORK_ADD, ((1, -5), (0, 1), 0)),
    (Kind.REMOTE, ("torch:full", ((2,), 1.0), {}, None, (0, 2**200), (0, 1))),
])
def test_malformed_rref_requests_get_a_named_error(rpc_world, kind, body):
    with pytest.raises(ForbiddenRRef):
        _forge(kind, body)
    assert rpc.rpc_sync(OWNER, helpers.my_name) == OWNER  # the connection still serves
