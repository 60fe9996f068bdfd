"""Records in a c10d store that carry a MAC under a group secret.

[Note: signed store records] The c10d store has no authentication: any process that reaches
its port can write or overwrite any key. A record that a rank trusts (a worker's address, a
barrier's arrival, a heartbeat) is therefore written as

    b"SWS1" | HMAC-SHA256(secret, "shardwise-store-v1" | scope | key | value) | value

and read back only if its MAC holds. ``scope`` names the job, group or attempt the record
belongs to, so a record copied from another key fails, and one copied from another job or an
earlier attempt fails when the scope holds an identity no other job or attempt has (a random
one the members agreed on, distributed/job_identity.py): a constant scope binds nothing, since
every job of a user may share the secret. The key inside the MAC is the key as passed to
:func:`put` (under a ``PrefixStore``, the key below its prefix: give the prefix's meaning in
``scope``). A record that fails is ignored and logged once (a warning naming the key), and a
wait goes on for a true one until its timeout. A process without the secret can still delete
or overwrite records, which makes a wait time out (a named error), never take a false value.

API (stable; the launcher's records use it too):

- ``put(store, key, value, secret, scope="")``: write a signed record.
- ``get(store, key, secret, scope="")``: the value (bytes) if the key holds a true record,
  else None (absent, or failed: logged).
- ``check(store, key, secret, scope="")``: ``get(...) is not None``.
- ``wait(store, key, secret, timeout, scope="", what=None)``: the value of a true record,
  polling until one is there; :class:`SignedRecordTimeout` after ``timeout`` seconds, naming
  the key and whether a false record was seen.
- ``seal(key, value, secret, scope="")`` / ``open_record(key, raw, secret, scope="")``: the
  same without a store (``open_record`` raises :class:`BadRecord`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time

log = logging.getLogger("shardwise.store")

MAGIC = b"SWS1"
_TAG = hashlib.sha256().digest_size
_LABEL = b"shardwise-store-v1"


class BadRecord(ValueError):
    """A store record that is not a true record of this group (no or a wrong MAC)."""


class SignedRecordTimeout(TimeoutError):
    """No true record under a key within the wait's timeout."""


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _tag(key: str, value: bytes, secret: bytes, scope: str) -> bytes:
    msg = b"\0".join([_LABEL, scope.encode(), key.encode(), value])
    return hmac.new(secret, msg, hashlib.sha256).digest()


def seal(key: str, value: bytes | str, secret: bytes, scope: str = "") -> bytes:
    """The stored form of ``value`` under ``key``."""
    if not secret:
        raise ValueError("a signed store record needs a non-empty secret")
    data = _as_bytes(value)
    return MAGIC + _tag(key, data, secret, scope) + data


def open_record(key: str, raw: bytes, secret: bytes, scope: str = "") -> bytes:
    """The value of a stored record, or :class:`BadRecord` saying why it is not true."""
    raw = bytes(raw)
    if len(raw) < len(MAGIC) + _TAG or raw[:len(MAGIC)] != MAGIC:
        raise BadRecord(f"store record {key!r} is not signed")
    tag, data = raw[len(MAGIC):len(MAGIC) + _TAG], raw[len(MAGIC) + _TAG:]
    if not hmac.compare_digest(tag, _tag(key, data, secret, scope)):
        raise BadRecord(f"store record {key!r} fails its MAC (not written by a holder of the "
                        "group secret, or copied from another key or job)")
    return data


def put(store, key: str, value: bytes | str, secret: bytes, scope: str = "") -> None:
    """Write ``value`` under ``key`` with its MAC."""
    store.set(key, seal(key, value, secret, scope))


_logged: set[tuple[str, bytes]] = set()  # (key, digest of the false record) warned about
_logged_lock = threading.Lock()
_LOGGED_MAX = 4096


def _warn_once(key: str, raw: bytes, why: BadRecord) -> None:
    mark = (key, hashlib.sha256(raw).digest())
    with _logged_lock:
        if mark in _logged:
            return
        if len(_logged) >= _LOGGED_MAX:
            _logged.clear()
        _logged.add(mark)
    log.warning("shardwise: ignored a store record: %s", why)


def get(store, key: str, secret: bytes, scope: str = "") -> bytes | None:
    """The value of the true record under ``key``; None when there is none (a false record
    is logged once and ignored)."""
    if not store.check([key]):
        return None
    raw = store.get(key)
    try:
        return open_record(key, raw, secret, scope)
    except BadRecord as why:
        _warn_once(key, bytes(raw), why)
        return None


def check(store, key: str, secret: bytes, scope: str = "") -> bool:
    """Whether ``key`` holds a true record."""
    return get(store, key, secret, scope) is not None


def wait(store, key: str, secret: bytes, timeout: float, scope: str = "",
         what: str | None = None) -> bytes:
    """The value of the true record under ``key``, polling until it is there (false records
    are skipped); :class:`SignedRecordTimeout` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        value = get(store, key, secret, scope)
        if value is not None:
            return value
        if time.monotonic() > deadline:
            seen = store.check([key])
            detail = "only a record that fails its MAC was there" if seen else "none was written"
            raise SignedRecordTimeout(f"no true store record {key!r}"
                                      f"{' (' + what + ')' if what else ''} within "
                                      f"{timeout:g} s: {detail}")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)
