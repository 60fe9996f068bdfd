"""The secret under which a launcher and its ranks sign the records they trust in the store.

[Note: launcher records] The rendezvous store has no authentication: any process that reaches
its port can read, list, write and delete any key. So every record the launchers and their
ranks write there and later act on (progress records, node-rank claims, node records, lost-node
marks, the next attempt, node 0's port for the node link, the job's and each attempt's identity
rounds) is written with distributed/signed_store.py's MAC under this secret, with the record's
key inside the MAC; a record that fails is ignored and logged. The MAC proves only who wrote a
record, and every job of a user who sets ``$SHARDWISE_RPC_SECRET`` shares the secret, so
records are also bound to their job: the nodes' records are signed under the job's identity
(agreed at rendezvous, distributed/job_identity.py) and the ranks' progress records under their
attempt's identity (``$SHARDWISE_ATTEMPT_ID``); only node 0's secret check, claims, node 0's
port and each node's first record of its flags, written before the job has an identity, are
signed under the secret alone (their worst copy makes a rendezvous wait or stop, named). And
since anyone can still delete a record or write a true one back, none of them is evidence that
a rank or a node is gone: that comes over channels no one else can write into (each rank's
pipe, progress.py; the launchers' own connections, node_link.py), which also carry failure
reports, stop notices and "finished". Counters made with the store's ``add`` cannot carry a
MAC; the launcher keeps none.

Where the secret comes from (the RPC's rule, rpc/trust/secret.py, for several hosts):

* ``$SHARDWISE_RPC_SECRET``, or the file named by ``$SHARDWISE_RPC_SECRET_FILE`` (owned by this
  user, not readable or writable by group or others), when set: the same on every node;
* else, on one node, 32 random bytes the launcher draws for the job;
* else, for several launchers on one host (node 0's host), a file of mode 0600 that node 0
  writes in a directory of mode 0700 of this user, named by a random id published in the
  store; launchers on other hosts without a secret are refused (``NodeError`` saying how to
  set one).

The launcher hands it to its ranks as ``$SHARDWISE_LAUNCH_SECRET`` (hex; the environment of a
process is readable only by its user).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from shardwise.distributed.env import RPC_SECRET_VAR, str_var
from shardwise.distributed.private_files import private_dir, read_private_file, user_secret

LAUNCH_SECRET_VAR = "SHARDWISE_LAUNCH_SECRET"


class SecretFileError(RuntimeError):
    """A secret file that may not be trusted (another owner, open to others, unreadable)."""


def from_environment(environ: Mapping[str, str]) -> bytes | None:
    """The secret the user set for the job (``$SHARDWISE_RPC_SECRET`` or its file, in
    ``environ``: the environment the launcher gives its ranks), or None."""
    return user_secret(environ.get, SecretFileError)


def of_rank() -> bytes | None:
    """In a rank: the secret its launcher handed it, or None (not started by our launcher)."""
    value = str_var(LAUNCH_SECRET_VAR, "")
    try:
        return bytes.fromhex(value) or None
    except ValueError:
        return None


def fresh() -> bytes:
    return secrets.token_bytes(32)


def _private_dir() -> Path:
    return private_dir("shardwise-launch", f"set ${RPC_SECRET_VAR}", SecretFileError)


def write_shared(secret: bytes) -> tuple[str, Path]:
    """Node 0 without a given secret: write ``secret`` for the launchers on this host; (the
    file's id, to publish; its path, to delete when the job ends)."""
    file_id = secrets.token_hex(16)
    path = _private_dir() / f"secret-{file_id}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret.hex().encode())
    return file_id, path


def read_shared(file_id: str) -> bytes:
    """Another launcher on node 0's host: the secret node 0 wrote under ``file_id``."""
    if not file_id.isalnum():
        raise SecretFileError(f"the job's secret file id {file_id!r} is not a plain name")
    text = read_private_file(_private_dir() / f"secret-{file_id}", "the job's secret file",
                             SecretFileError)
    try:
        return bytes.fromhex(text.decode())
    except ValueError as exc:
        raise SecretFileError("the job's secret file does not hold a hex secret") from exc
