"""Signed store records ([Note: signed store records] in distributed/signed_store.py): a
process without the secret cannot make a reader take a false value."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from shardwise.distributed import signed_store

SECRET = b"k" * 32


def test_true_record_round_trips():
    store = dist.HashStore()
    signed_store.put(store, "worker/0", '{"port": 1}', SECRET, scope="g1")
    assert signed_store.get(store, "worker/0", SECRET, scope="g1") == b'{"port": 1}'
    assert signed_store.check(store, "worker/0", SECRET, scope="g1")
    assert signed_store.wait(store, "worker/0", SECRET, 1.0, scope="g1") == b'{"port": 1}'


@pytest.mark.parametrize("forge", ["plain", "other_secret", "other_key", "other_scope",
                                   "flipped", "truncated"])
def test_false_record_is_ignored_and_logged(forge, caplog):
    store = dist.HashStore()
    good = signed_store.seal("shutdown/1", "1", SECRET, scope="g1")
    raw = {
        "plain": b"1",
        "other_secret": signed_store.seal("shutdown/1", "1", b"x" * 32, scope="g1"),
        "other_key": signed_store.seal("shutdown/0", "1", SECRET, scope="g1"),
        "other_scope": signed_store.seal("shutdown/1", "1", SECRET, scope="g0"),
        "flipped": good[:-1] + bytes([good[-1] ^ 1]),
        "truncated": good[:20],
    }[forge]
    store.set("shutdown/1", raw)
    with caplog.at_level(logging.WARNING, logger="shardwise.store"):
        assert signed_store.get(store, "shutdown/1", SECRET, scope="g1") is None
        assert not signed_store.check(store, "shutdown/1", SECRET, scope="g1")
    assert any("shutdown/1" in r.getMessage() for r in caplog.records)
    with pytest.raises(signed_store.SignedRecordTimeout, match="fails its MAC"):
        signed_store.wait(store, "shutdown/1", SECRET, 0.05, scope="g1")
    with pytest.raises(signed_store.BadRecord):
        signed_store.open_record("shutdown/1", raw, SECRET, scope="g1")


def test_absent_record():
    store = dist.HashStore()
    assert signed_store.get(store, "left/1", SECRET) is None
    with pytest.raises(signed_store.SignedRecordTimeout, match="none was written"):
        signed_store.wait(store, "left/1", SECRET, 0.05)


def test_wait_takes_the_true_record_written_after_a_false_one():
    store = dist.HashStore()
    store.set("worker/0", b"forged")
    import threading
    timer = threading.Timer(0.1, signed_store.put, (store, "worker/0", "real", SECRET))
    timer.start()
    try:
        assert signed_store.wait(store, "worker/0", SECRET, 5.0) == b"real"
    finally:
        timer.join()


def test_empty_secret_refused():
    with pytest.raises(ValueError, match="secret"):
        signed_store.seal("k", "v", b"")
