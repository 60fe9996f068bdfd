"""Issue 46 point 2, RPC side: a signed RPC record (``shutdown``, ``left``) copied from another
job that uses the same ``SHARDWISE_RPC_SECRET``, or from an earlier ``init_rpc`` of the same
processes, is refused and logged, even when an outsider pins the store's public group id to
the earlier group's. The group key holds an id the workers agree on at rendezvous
([Note: job identity] in distributed/job_identity.py), which no earlier record can carry.

Before: the group key was ``sha256(secret | group id)`` with the group id read unsigned from
the store, so a pinned id gave job B job A's key and A's records verified in B: rank 0 took
A's ``shutdown/1`` and ``left/1`` as rank 1's, left while rank 1 still called it, and its
shutdown could end with a false ``WorkerDied``.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch.distributed as dist

from shardwise.distributed.env import RPC_SECRET_FILE_VAR, RPC_SECRET_VAR
from shardwise.rpc import rendezvous
from shardwise.rpc.trust import secret
from tests.harness import procs
from tests.rpc.conftest import ROOT, python_path
from tests.rpc.replayed_records import CALLS
from tests.rpc.scenarios import lines

GROUP = "secret/group_id"


@pytest.fixture
def cluster_secret(monkeypatch):
    """Both jobs run with the same user secret, as the docs tell multi-node users to set."""
    monkeypatch.setenv(RPC_SECRET_VAR, "one-secret-for-every-job")
    monkeypatch.delenv(RPC_SECRET_FILE_VAR, raising=False)


def _wait_key(store, key: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < deadline, f"{key} never written"
        time.sleep(0.002)


def _keys(store, world: int = 2, pin: bytes | None = None) -> list[bytes]:
    """Every rank's group key from ``secret.group_key``. With ``pin``, the outsider overwrites
    the group id once rank 0 wrote it and before any other rank reads it (rank 0 is still
    waiting for their host records then, so it reads the pinned id too)."""
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        try:
            out[rank] = secret.group_key(store, rank, world, "127.0.0.1:1", timeout=20)[0]
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out[rank] = exc

    first = threading.Thread(target=one, args=(0,))
    first.start()
    if pin is not None:
        _wait_key(store, GROUP)
        store.set(GROUP, pin)
    rest = [threading.Thread(target=one, args=(r,)) for r in range(1, world)]
    for t in rest:
        t.start()
    for t in [first, *rest]:
        t.join(60)
    keys = [out[r] for r in range(world)]
    assert all(isinstance(k, bytes) for k in keys), keys
    assert len(set(keys)) == 1
    return keys


def _replayed_arrival_is_refused(store, key: bytes, name: str, raw: bytes, caplog) -> None:
    """Rank 0 waits at barrier ``name`` while the only record of rank 1 there is ``raw``."""
    store.set(f"{name}/1", raw)
    with caplog.at_level(logging.WARNING, logger="shardwise.store"):
        missing = rendezvous.barrier(store, name, 0, 2, 0.3, key)
    assert missing == [1], f"rank 0 took a replayed {name}/1 record as rank 1's arrival"
    assert any(f"{name}/1" in r.getMessage() and "ignored a store record" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("name", ["shutdown", "left"])
def test_a_record_from_another_job_with_the_same_secret_is_refused(name, cluster_secret,
                                                                   caplog):
    job_a = dist.HashStore()
    key_a = _keys(job_a)[0]
    rendezvous.arrive(job_a, name, 1, key_a)  # job A's rank 1, as it shut down
    job_b = dist.HashStore()
    key_b = _keys(job_b, pin=job_a.get(GROUP))[0]  # job A's public group id, pinned in B
    _replayed_arrival_is_refused(job_b, key_b, name, job_a.get(f"{name}/1"), caplog)


@pytest.mark.parametrize("name", ["shutdown", "left"])
def test_a_record_from_an_earlier_init_of_the_same_processes_is_refused(name, cluster_secret,
                                                                        caplog):
    shared = dist.HashStore()
    first = dist.PrefixStore(f"{rendezvous.PREFIX}/0", shared)  # the first init_rpc's keys
    key_first = _keys(first)[0]
    rendezvous.arrive(first, name, 1, key_first)
    second = dist.PrefixStore(f"{rendezvous.PREFIX}/1", shared)  # the second init_rpc's
    key_second = _keys(second, pin=first.get(GROUP))[0]
    _replayed_arrival_is_refused(second, key_second, name, first.get(f"{name}/1"), caplog)


class _ReadsAnotherGroupId(dist.Store):
    """One rank's view of a store where an outsider rewrote the group id between the other
    ranks' reads and this rank's."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def get(self, key: str) -> bytes:
        return b"an-outsiders-id" if key == GROUP else self.inner.get(key)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)


def test_ranks_given_different_group_ids_refuse_to_form_the_group(cluster_secret):
    """The agreement fails (RendezvousError naming the store), bounded by the timeout."""
    store, out = dist.HashStore(), {}

    def one(rank: int) -> None:
        view = store if rank == 0 else _ReadsAnotherGroupId(store)
        try:
            secret.group_key(view, rank, 2, "127.0.0.1:1", timeout=0.5)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rank in range(2):
        assert isinstance(out.get(rank), rendezvous.RendezvousError), out
        assert "may have been tampered with" in str(out[rank])


def test_two_groups_with_one_secret_and_a_pinned_group_id_get_different_keys(cluster_secret):
    job_a = dist.HashStore()
    key_a = _keys(job_a)[0]
    assert _keys(dist.HashStore(), pin=job_a.get(GROUP))[0] != key_a
    assert os.environ[RPC_SECRET_VAR]  # (the same user secret for both)


# ---------------------------------------------------------------- whole workers
FIRST, SECOND = f"{rendezvous.PREFIX}/0/", f"{rendezvous.PREFIX}/1/"
REPLAYED = ("shutdown/0", "shutdown/1", "left/1")


def _host_store() -> dist.TCPStore:
    """A store the test hosts at MASTER_ADDR / MASTER_PORT, as a launcher does."""
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


def _run_group(store, mode: str, where, outsider=None, **extra: str) -> list[tuple[int, str]]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="1", PYTHONPATH=python_path(),
               OMP_NUM_THREADS="1", SCENARIO_DIR=str(where), REPLAY_MODE=mode,
               SHARDWISE_RPC_ADDR="127.0.0.1", **extra)
    programs = [procs.start(["-m", "tests.rpc.replayed_records"], dict(env, RANK=str(r)), ROOT)
                for r in range(2)]
    if outsider is not None:
        threading.Thread(target=outsider, daemon=True).start()
    out = procs.outputs(programs, 180)
    return out


def _pin_and_replay(store, prefix: str, group_id: bytes, records: dict[str, bytes], where,
                    done: threading.Event) -> None:
    """The outsider: once rank 0 wrote the group id, pin it to ``group_id`` and write the
    copied ``records``; then let rank 1 join (rank 0 reads the group id only once rank 1's
    host record is there, so both read the pinned one)."""
    _wait_key(store, prefix + GROUP, 60)
    store.set(prefix + GROUP, group_id)
    for name, raw in records.items():
        store.set(prefix + name, raw)
    (where / "pinned").touch()
    done.set()


def _healthy_despite_the_replay(out: list[tuple[int, str]], done: threading.Event) -> None:
    assert done.is_set(), "the outsider never saw rank 0's group id"
    for code, text in out:
        assert code == 0, text
        assert lines(text)["shutdown"] == "returned", text
    assert lines(out[1][1])["calls ok"] == str(CALLS), out[1][1]
    assert lines(out[0][1])["rank 1 done before rank 0 left"] == "True", out[0][1]
    assert "ignored a store record" in out[0][1], out[0][1]


def test_workers_of_another_job_with_the_same_secret_cannot_end_this_one(cluster_secret,
                                                                          tmp_path):
    """Job A runs to its end; its group id and its shutdown/left records go into job B's
    store. Before: B's rank 0 took them, left at once, and rank 1's calls failed."""
    job_a = _host_store()
    (tmp_path / "a").mkdir()
    for code, text in _run_group(job_a, "clean", tmp_path / "a"):
        assert code == 0 and lines(text)["shutdown"] == "returned", text
    copied = {name: job_a.get(FIRST + name) for name in REPLAYED}
    job_b, done = _host_store(), threading.Event()
    (tmp_path / "b").mkdir()
    out = _run_group(job_b, "job", tmp_path / "b", lambda: _pin_and_replay(
        job_b, FIRST, job_a.get(FIRST + GROUP), copied, tmp_path / "b", done))
    _healthy_despite_the_replay(out, done)


def _earlier_init_replayed(tmp_path, **extra: str) -> list[tuple[int, str]]:
    store, done = _host_store(), threading.Event()

    def outsider() -> None:
        _wait_key(store, SECOND + GROUP, 120)  # (rank 0's first group is over by then)
        copied = {name: store.get(FIRST + name) for name in REPLAYED}
        _pin_and_replay(store, SECOND, store.get(FIRST + GROUP), copied, tmp_path, done)

    out = _run_group(store, "reinit", tmp_path, outsider, **extra)
    for _, text in out:
        assert lines(text)["first group"] == "done", text
    _healthy_despite_the_replay(out, done)
    return out


def test_records_of_the_workers_earlier_init_rpc_cannot_end_the_next_group(cluster_secret,
                                                                           tmp_path):
    _earlier_init_replayed(tmp_path)


def test_a_shutdown_record_replayed_before_every_read_blames_no_one(cluster_secret, tmp_path):
    """Rank 0 never reads rank 1's true shutdown record (the outsider's copy from the first
    group is there at every read), yet rank 1 called shutdown() and said so over its
    connection: rank 0's shutdown returns. Before: after the group key was bound to the job,
    rank 0 waited until rank 1 left, then raised a false ``WorkerDied ... rank 1 died before
    calling shutdown()``."""
    _earlier_init_replayed(tmp_path, REPLAY_EVERY_READ="1")


def test_a_restarted_attempt_meets_apart_from_the_records_of_the_last(cluster_secret, tmp_path):
    """A launcher's store outlives an attempt; the ranks of the next one (fresh processes, so
    their first ``init_rpc`` again) meet under their attempt's own prefix, as torch's ranks do
    (TORCHELASTIC_RESTART_COUNT), and never read the last attempt's group id or records."""
    store = _host_store()
    for attempt in range(2):
        where = tmp_path / str(attempt)
        where.mkdir()
        out = _run_group(store, "clean", where, TORCHELASTIC_RESTART_COUNT=str(attempt),
                         CONNECT_TIMEOUT="20")
        for code, text in out:
            assert code == 0 and lines(text)["shutdown"] == "returned", (attempt, text)
        assert lines(out[1][1])["calls ok"] == str(CALLS), (attempt, out[1][1])
