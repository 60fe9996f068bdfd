"""The job identity ([Note: job identity] in distributed/job_identity.py): members agree on one
fresh id, and no record copied from another run can make them take that run's id."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from shardwise.distributed import signed_store
from shardwise.distributed.job_identity import JobIdentityError, agree

SECRET = b"s" * 32
SCOPE = "test-group"
PREFIX = "ident"


def _run(store, count: int, timeout: float = 30.0, members=None) -> list:
    """Every member's result (its id, or the exception it raised), in member order."""
    members = list(range(count)) if members is None else members

    def one(index):
        try:
            return agree(store, PREFIX, index, count, SECRET, SCOPE, timeout)
        except JobIdentityError as exc:
            return exc

    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(one, members))


def _keys(count: int) -> list[str]:
    return [f"{PREFIX}/{kind}/{m}" for kind in ("nonce", "confirm") for m in range(count)]


@pytest.mark.parametrize("count", [1, 2, 4])
def test_members_agree_on_one_id(count):
    ids = _run(dist.HashStore(), count)
    assert all(isinstance(i, bytes) and len(i) == 32 for i in ids)
    assert len(set(ids)) == 1


def test_two_runs_give_different_ids():
    first, second = _run(dist.HashStore(), 2), _run(dist.HashStore(), 2)
    assert first[0] != second[0]


def test_stale_records_of_an_earlier_run_under_the_same_prefix_give_a_fresh_id():
    store = dist.HashStore()
    earlier = _run(store, 2)[0]
    later = _run(store, 2)
    assert later[0] == later[1] and later[0] != earlier


def test_records_replayed_into_another_store_before_the_run_give_a_fresh_id():
    old_store = dist.HashStore()
    old_id = _run(old_store, 2)[0]
    store = dist.HashStore()
    for key in _keys(2):
        store.set(key, old_store.get(key))
    ids = _run(store, 2)
    assert ids[0] == ids[1] and ids[0] != old_id


def test_an_absent_member_replayed_from_an_earlier_run_is_refused():
    """Member 1 never runs; its nonce and confirm from run A sit in the store."""
    old_store = dist.HashStore()
    _run(old_store, 2)
    store = dist.HashStore()
    for key in (f"{PREFIX}/nonce/1", f"{PREFIX}/confirm/1"):
        store.set(key, old_store.get(key))
    with pytest.raises(JobIdentityError, match="may have been tampered with") as info:
        agree(store, PREFIX, 0, 2, SECRET, SCOPE, 0.5)
    assert "member 1" not in str(info.value) and "rank" not in str(info.value)


def test_records_replayed_during_the_run_never_give_the_old_id():
    """A thread keeps writing run A's records for member 1 into run B's store: B's members
    either agree on a fresh id or raise JobIdentityError; none takes A's id."""
    old_store = dist.HashStore()
    old_id = _run(old_store, 2)[0]
    old = {key: old_store.get(key) for key in _keys(2)}
    store, stop = dist.HashStore(), threading.Event()

    def replay():
        while not stop.is_set():
            for key in (f"{PREFIX}/nonce/1", f"{PREFIX}/confirm/1"):
                store.set(key, old[key])
            stop.wait(0.0005)

    attacker = threading.Thread(target=replay)
    attacker.start()
    try:
        results = _run(store, 2, timeout=2.0)
    finally:
        stop.set()
        attacker.join()
    ids = [r for r in results if isinstance(r, bytes)]
    assert old_id not in ids
    assert all(isinstance(r, (bytes, JobIdentityError)) for r in results)
    assert len(set(ids)) <= 1


def test_unsigned_records_are_ignored_and_logged(caplog):
    store = dist.HashStore()
    store.set(f"{PREFIX}/nonce/1", b"x" * 32)
    with (caplog.at_level(logging.WARNING, logger="shardwise.store"),
          pytest.raises(JobIdentityError, match="1 of 2 nonce records")):
        agree(store, PREFIX, 0, 2, SECRET, SCOPE, 0.3)
    assert any(f"{PREFIX}/nonce/1" in r.getMessage() for r in caplog.records)


def test_a_record_signed_under_another_scope_does_not_count():
    store = dist.HashStore()
    other = _run(store, 2)  # (records under SCOPE)
    assert isinstance(other[0], bytes)
    with pytest.raises(JobIdentityError):
        agree(store, PREFIX, 0, 2, SECRET, "another-scope", 0.3)


def test_a_member_alone_times_out_with_a_named_error():
    with pytest.raises(JobIdentityError, match="0 of 2|1 of 2"):
        agree(dist.HashStore(), PREFIX, 0, 2, SECRET, SCOPE, 0.2)


def test_confirms_missing_are_named_as_the_store_s_problem():
    """Both nonces are there (member 1's signed, as its holder would write it) but member 1
    never confirms: the error names the confirm round and the store."""
    store = dist.HashStore()
    signed_store.put(store, f"{PREFIX}/nonce/1", b"n" * 32, SECRET, f"{SCOPE}|job-identity/nonce")
    with pytest.raises(JobIdentityError, match="1 of 2 confirm records.*tampered"):
        agree(store, PREFIX, 0, 2, SECRET, SCOPE, 0.3)


@pytest.mark.parametrize("kwargs, match", [
    ({"count": 0}, "count"), ({"index": 2}, "index"), ({"index": -1}, "index"),
    ({"secret": b""}, "secret"), ({"timeout": 0}, "timeout"), ({"prefix": ""}, "prefix"),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    args = {"store": dist.HashStore(), "prefix": PREFIX, "index": 0, "count": 2,
            "secret": SECRET, "scope": SCOPE, "timeout": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        agree(**args)
