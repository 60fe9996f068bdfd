"""The group secret that RPC handshakes prove (wire/auth.py): never written to the store.

[Note: group secret] The c10d store has no authentication and listens on every interface, so
nothing in it may let a process join. The secret comes, in this order, from:

1. ``$SHARDWISE_RPC_SECRET`` (any string; ``shardwise run`` and ``shardwise train`` on one host
   generate one for their ranks; a cluster job sets the same one on every node), or the file
   named by ``$SHARDWISE_RPC_SECRET_FILE`` (its contents; it must be a regular file owned by
   this user and neither readable nor writable by group or others: another user's file, even
   of mode 0600, could have been written by that user);
2. on one host, with neither set (torchrun, a plain ``env://`` script, a test harness): rank 0
   writes 32 random bytes to a file of mode 0600 in a directory of mode 0700 owned by this user
   (``$XDG_RUNTIME_DIR/shardwise-rpc`` or ``/tmp/shardwise-rpc-<uid>``), named from the
   rendezvous address and a random id that rank 0 publishes in the store; the other ranks read
   it. Only processes of the same user on the same host can. Rank 0 deletes the file once every
   worker has connected;
3. a group spread over several hosts with neither set is refused (RendezvousError saying how to
   set the secret): no host could read another's file.

Every rank publishes its host's identity (``/etc/machine-id`` or the hostname) to decide 2 or 3
(a liar can only make the group refuse itself).

[Note: group key] The handshake key, which also signs every RPC store record, is
``sha256(sha256(secret | group id) | job id)``. The group id is random but public and unsigned
(rank 0 writes it to the store; anyone can overwrite it, for instance with an earlier group's),
so it only names the one-host secret file. The job id is what makes two groups' keys differ:
the workers agree on it at rendezvous (``distributed/job_identity.agree``: every worker's fresh
nonce, then a confirm round, signed under the secret), so no record of another job that uses
the same ``$SHARDWISE_RPC_SECRET``, nor of an earlier ``init_rpc`` of the same processes, can
verify under this group's key: a replayed ``shutdown`` or ``left`` is ignored and logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import time
from pathlib import Path

import torch.distributed as dist

from shardwise.distributed import job_identity
from shardwise.distributed.env import RPC_SECRET_FILE_VAR, RPC_SECRET_VAR, str_var
from shardwise.distributed.private_files import host_identity, user_secret
from shardwise.distributed.private_files import private_dir as private_dir_of
from shardwise.rpc.rendezvous import RendezvousError

_GROUP_KEY = "secret/group_id"
_IDENTITY_PREFIX = "identity"  # the job identity's records, under this init_rpc's prefix
_IDENTITY_SCOPE = "shardwise-rpc-identity"


class SecretError(RendezvousError):
    """No group secret could be found or agreed on; the message says how to provide one."""


class SecretFileError(SecretError):
    """``$SHARDWISE_RPC_SECRET_FILE`` is not a private file of this user."""


def from_environment() -> bytes | None:
    """The secret the launcher or the user set, or None."""
    return user_secret(str_var, SecretFileError)


def private_dir() -> Path:
    """A directory only this user can enter (created 0700; refused if someone else owns it
    or it is open to others)."""
    return private_dir_of("shardwise-rpc", f"set ${RPC_SECRET_VAR}", SecretError)


def _file_name(address: str, group_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in address)
    return f"secret-{safe}-{group_id}"


def group_key(store: dist.Store, rank: int, world_size: int, address: str,
              timeout: float) -> tuple[bytes, Path | None]:
    """The handshake key of this group ([Note: group key]), and the secret file rank 0 must
    delete once everyone connected (None when the secret came from the environment).
    ``store`` is this ``init_rpc``'s scoped store; ``address`` the rendezvous address (names
    the file). Besides the host records and the group id, the workers agree on a job id (two
    signed store rounds) that the key holds."""
    store.set(f"secret/host/{rank}", host_identity())
    if rank == 0:
        store.set(_GROUP_KEY, secrets.token_hex(16))
    _wait(store, [_GROUP_KEY] + [f"secret/host/{r}" for r in range(world_size)], timeout)
    group_id = store.get(_GROUP_KEY).decode()
    secret, path = from_environment(), None
    if secret is None:
        hosts = {store.get(f"secret/host/{r}").decode() for r in range(world_size)}
        if len(hosts) > 1:
            raise SecretError(
                f"this RPC group spans {len(hosts)} hosts and no group secret is set: set "
                f"${RPC_SECRET_VAR} (the same value on every node, e.g. from "
                f"`python -c 'import secrets; print(secrets.token_hex(32))'`) or "
                f"${RPC_SECRET_FILE_VAR} (a file of mode 0600) for every rank")
        secret, path = _shared_file(store, rank, address, group_id, timeout)
    base = hashlib.sha256(b"shardwise-rpc-v1|" + secret + b"|" + group_id.encode()).digest()
    try:
        job_id = job_identity.agree(store, _IDENTITY_PREFIX, rank, world_size, base,
                                    _IDENTITY_SCOPE, timeout)
    except job_identity.JobIdentityError as exc:
        remove(path)
        raise RendezvousError(f"RPC rank {rank}: {exc}") from exc
    return hashlib.sha256(b"shardwise-rpc-v2|" + base + b"|" + job_id).digest(), path


def _shared_file(store: dist.Store, rank: int, address: str, group_id: str,
                 timeout: float) -> tuple[bytes, Path | None]:
    path = private_dir() / _file_name(address, group_id)
    if rank == 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        store.set("secret/written", "1")
        return path.read_bytes(), path
    _wait(store, ["secret/written"], timeout)
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise SecretError(f"{path} is not a regular file of this user")
        return path.read_bytes(), None
    except FileNotFoundError as exc:
        raise SecretError(f"rank {rank} cannot find the group secret file {path} that rank 0 "
                          f"wrote: is this rank on another host? Set ${RPC_SECRET_VAR} for "
                          "groups across hosts") from exc


def remove(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def _wait(store: dist.Store, keys: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise SecretError(f"RPC rendezvous: {missing} not published within {timeout:.0f} s")
        time.sleep(0.005)
