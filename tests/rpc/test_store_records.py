"""Issue 25 point 5, RPC side: records in the c10d store written by a local process without
the group secret change nothing (ignored and logged), so nobody can end a rank, make it leave,
or redirect a connection through the store."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from shardwise.distributed import signed_store
from shardwise.rpc import rendezvous
from tests.rpc.forged_records import CALLS
from tests.rpc.scenarios import lines

KEY = b"k" * 32


def _attacker(port: int, where, done: threading.Event) -> None:
    """Write forged ``shutdown/1`` and ``left/1`` records once both workers have published
    their addresses (a plain value, and one signed with a key of its own), then say so."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    prefix = "shardwise_rpc/0/"
    deadline = time.monotonic() + 60
    while not store.check([prefix + "worker/0", prefix + "worker/1"]):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    for name in ("shutdown/1", "left/1", "shutdown/0"):
        store.set(prefix + name, "1")
    time.sleep(0.3)  # (rank 0 polls the barrier meanwhile)
    for name in ("shutdown/1", "left/1"):
        store.set(prefix + name, signed_store.seal(name, "1", b"a" * 32, "shardwise-rpc"))
    time.sleep(0.3)
    (where / "forged").touch()
    done.set()


def test_forged_shutdown_and_left_records_change_nothing(tmp_path):
    """Before: rank 0 took the forged records as rank 1's arrival at shutdown and its leave,
    left, and rank 1's calls failed (WorkerDied)."""
    from tests.harness.ports import reserved_port

    with reserved_port() as port:  # until the workers are done: rank 0's store binds it
        _forged_records_change_nothing(tmp_path, port)


def _forged_records_change_nothing(tmp_path, port):
    from tests.harness import procs
    from tests.rpc.conftest import ROOT, python_path

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PYTHONPATH=python_path(), OMP_NUM_THREADS="1", SCENARIO_DIR=str(tmp_path))
    programs = [procs.start(["-m", "tests.rpc.forged_records"], dict(env, RANK=str(r)), ROOT)
             for r in range(2)]
    done = threading.Event()
    attacker = threading.Thread(target=_attacker, args=(port, tmp_path, done), daemon=True)
    attacker.start()
    out = procs.outputs(programs, 180)
    assert done.is_set(), "the attacker never saw the workers' records"
    for code, text in out:
        assert code == 0, text
        assert lines(text)["shutdown"] == "returned", text
    assert lines(out[1][1])["calls ok"] == str(CALLS), out[1][1]
    assert lines(out[0][1])["rank 1 done before rank 0 left"] == "True", out[0][1]
    assert "ignored a store record" in out[0][1]  # logged by the worker that read it


def test_a_rewritten_address_record_is_not_taken():
    """The attacker's address for rank 0 (its relay's port), plain or signed with its own
    key, is ignored; the true record, written after it, is what the exchange returns."""
    store = dist.HashStore()
    relay = json.dumps({"name": "worker0", "host": "127.0.0.1", "port": 1, "devices": []})
    store.set("worker/0", relay)
    real = {"name": "worker0", "host": "127.0.0.1", "port": 2345, "devices": []}
    timer = threading.Timer(0.2, signed_store.put, (store, "worker/0", json.dumps(real), KEY,
                                                    rendezvous.SCOPE))
    timer.start()
    mine = {"name": "worker1", "host": "127.0.0.1", "port": 3456, "devices": []}
    records = rendezvous.exchange(store, 1, 2, mine, timeout=10, key=KEY)
    timer.join()
    assert records == [real, mine]


def test_an_overwritten_own_record_is_written_again_and_a_forged_one_times_out_named():
    store = dist.HashStore()
    mine = {"name": "worker0", "host": "127.0.0.1", "port": 2345, "devices": []}

    def overwrite_then_publish_rank1() -> None:
        time.sleep(0.1)
        store.set("worker/0", json.dumps({**mine, "port": 1}))  # the attacker's rewrite
        time.sleep(0.2)
        signed_store.put(store, "worker/1", json.dumps({**mine, "name": "worker1"}), KEY,
                         rendezvous.SCOPE)

    t = threading.Thread(target=overwrite_then_publish_rank1)
    t.start()
    records = rendezvous.exchange(store, 0, 2, mine, timeout=10, key=KEY)
    t.join()
    assert records[0] == mine
    assert signed_store.get(store, "worker/0", KEY, rendezvous.SCOPE) == json.dumps(mine).encode()
    # a rank whose only record is forged: the error says so
    store.set("worker/1", json.dumps({**mine, "name": "worker1", "port": 1}))
    import pytest

    with pytest.raises(rendezvous.RendezvousError, match="ranks \\[1\\] fail their MAC"):
        rendezvous.exchange(store, 0, 2, mine, timeout=0.2, key=KEY)
