"""The group secret never travels through the store ([Note: group secret] in
rpc/trust/secret.py)."""

from __future__ import annotations

import hashlib
import os
import pwd
import socket
import stat
import threading
import time

import pytest
import torch.distributed as dist

import shardwise.rpc as rpc
from shardwise.distributed.env import RPC_SECRET_FILE_VAR, RPC_SECRET_VAR
from shardwise.rpc.current import get_agent
from shardwise.rpc.trust import secret
from shardwise.rpc.wire.auth import AuthError, address_of, connect_handshake
from tests.rpc import helpers


def _store_values(store, world: int) -> list[bytes]:
    keys = ["secret/group_id", "secret/written", *[f"secret/host/{r}" for r in range(world)],
            *[f"worker/{r}" for r in range(world)], *[f"ready/{r}" for r in range(world)]]
    return [bytes(store.get(k)) for k in keys if store.check([k])]


def _candidate_keys(values: list[bytes], group_id: bytes) -> list[bytes]:
    keys = []
    for v in values:
        keys += [v, hashlib.sha256(v).digest(), v[:32].ljust(32, b"\0"),
                 hashlib.sha256(b"shardwise-rpc-v1|" + v + b"|" + group_id).digest()]
    return keys


def test_outsider_with_the_store_contents_cannot_join(rpc_world):
    """Everything in the store, tried as the key, claiming the rank of a live worker: refused,
    and the worker keeps its connection and serves."""
    agent = get_agent()
    values = _store_values(agent.store, len(rpc_world))
    assert values, "the rendezvous keys are where the test expects them"
    group_id = bytes(agent.store.get("secret/group_id"))
    host, port = rpc.rpc_sync("worker1", helpers.listener_address)
    for key in _candidate_keys(values, group_id):
        with socket.create_connection((host, port), timeout=5) as sock, \
                pytest.raises((AuthError, ConnectionError)):
            # as worker2, already joined
            connect_handshake(sock, key, 2, 1, address_of(host, port))
    assert rpc.rpc_sync("worker1", helpers.call_other, args=("worker2", helpers.my_name)) \
        == "worker2"
    assert agent.transport._token not in values


def test_one_host_secret_file_is_private_and_gone_after_init(rpc_world):
    path = secret.private_dir()
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode == 0o700 and os.stat(path).st_uid == os.getuid()
    group_id = get_agent().store.get("secret/group_id").decode()
    assert not [p for p in path.iterdir() if p.name.endswith(group_id)]


def _group_key(store, rank, world, out, address="127.0.0.1:1"):
    try:
        out[rank] = secret.group_key(store, rank, world, address, timeout=10)
    except Exception as exc:  # noqa: BLE001 - compared by the test
        out[rank] = exc


def _run_ranks(world: int, store, before=None) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=_group_key, args=(store, r, world, out))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_multi_host_group_without_a_secret_is_refused(monkeypatch):
    monkeypatch.delenv(RPC_SECRET_VAR, raising=False)
    monkeypatch.delenv(RPC_SECRET_FILE_VAR, raising=False)
    store = dist.HashStore()
    store.set("secret/host/1", "host:another-node")  # rank 1 lives elsewhere
    out: dict = {}
    _group_key(store, 0, 2, out)
    assert isinstance(out[0], secret.SecretError)
    assert "spans 2 hosts" in str(out[0]) and RPC_SECRET_VAR in str(out[0])


def test_one_host_ranks_agree_through_the_file_and_env_secret_wins(monkeypatch):
    monkeypatch.delenv(RPC_SECRET_VAR, raising=False)
    monkeypatch.delenv(RPC_SECRET_FILE_VAR, raising=False)
    out = _run_ranks(3, dist.HashStore())
    keys = {out[r][0] for r in range(3)}
    assert len(keys) == 1 and out[0][1] is not None and out[1][1] is None
    secret.remove(out[0][1])
    monkeypatch.setenv(RPC_SECRET_VAR, "cluster-secret")
    out = _run_ranks(2, dist.HashStore())
    assert out[0][0] == out[1][0] and out[0][1] is None  # no file
    monkeypatch.setenv(RPC_SECRET_VAR, "another-secret")
    other = _run_ranks(2, dist.HashStore())
    assert other[0][0] != out[0][0]


def test_secret_file_readable_by_others_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(RPC_SECRET_VAR, raising=False)
    path = tmp_path / "secret"
    path.write_text("s3cret")
    path.chmod(0o644)
    monkeypatch.setenv(RPC_SECRET_FILE_VAR, str(path))
    with pytest.raises(secret.SecretError, match="chmod 600"):
        secret.from_environment()
    path.chmod(0o600)
    assert secret.from_environment() == b"s3cret"


def test_secret_file_of_another_owner_is_refused(monkeypatch, tmp_path):
    """Issue 25: a 0600 file owned by someone else was accepted (only its mode was checked);
    its owner could have chosen the secret."""
    monkeypatch.delenv(RPC_SECRET_VAR, raising=False)
    path = tmp_path / "secret"
    path.write_text("s3cret")
    path.chmod(0o600)
    monkeypatch.setenv(RPC_SECRET_FILE_VAR, str(path))
    if os.geteuid() == 0:
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    else:  # (not root: pretend this process runs as another user)
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(secret.SecretFileError, match="owned by uid"):
        secret.from_environment()


def test_secret_file_writable_by_others_or_not_a_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(RPC_SECRET_VAR, raising=False)
    path = tmp_path / "secret"
    path.write_text("s3cret")
    path.chmod(0o622)  # not readable, but writable by others
    monkeypatch.setenv(RPC_SECRET_FILE_VAR, str(path))
    with pytest.raises(secret.SecretFileError, match="writable"):
        secret.from_environment()
    monkeypatch.setenv(RPC_SECRET_FILE_VAR, str(tmp_path))  # a directory
    with pytest.raises(secret.SecretFileError, match="not a regular file"):
        secret.from_environment()


def test_outsider_connecting_as_a_rank_before_the_real_one_is_refused():
    """A slow worker's rank claimed first by an outsider (who read everything in the store):
    the outsider is refused and the real worker, arriving later, joins."""
    from tests.rpc.test_resources import _Server

    srv = _Server()
    try:
        with pytest.raises((AuthError, ConnectionError)):
            srv.join_as(1, token=hashlib.sha256(b"whatever the store held").digest())
        assert 1 not in srv.t.conns
        real = srv.join_as(1)
        deadline = time.monotonic() + 5
        while 1 not in srv.t.conns and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in srv.t.conns and srv.lost == []
        real.close()
    finally:
        srv.t.close()
