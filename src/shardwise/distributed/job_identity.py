"""A random identity that the members of a group agree on through a c10d store.

[Note: job identity] Signed store records ([Note: signed store records]) prove who wrote a
record, not when or for which job: a record signed under a constant scope, copied from
another job that uses the same secret, or from an earlier attempt of this one, still verifies.
:func:`agree` gives a group an identity that no earlier record can carry, so that a record
signed under a scope that includes it is refused everywhere else. Two store rounds:

1. **Nonces.** Every member draws a fresh random nonce, publishes it signed at
   ``{prefix}/nonce/{index}`` and reads everyone else's. The identity is a hash of ``scope``
   and all nonces in member order. A member takes its own nonce from memory, never from the
   store, so an identity it computes always holds its own fresh nonce: a replayed nonce from
   another run can only give a member an identity that no other member computes.
2. **Confirms.** Every member writes ``{prefix}/confirm/{index}``, signed under a scope that
   includes the identity it computed, and waits until every member's confirm verifies under
   that identity. A member that read a false (replayed, stale) nonce sees no confirm under its
   identity (the others did not compute it; a replayed confirm is signed under another run's
   identity), and keeps reading the nonces, so a true nonce written later still brings it to
   the group's identity. Once all confirms hold, every member has the same identity.

A record without a true MAC is ignored and logged once (signed_store's warning); a member
whose own records were overwritten writes them again. When the records are still missing or
disagree after ``timeout`` seconds, :class:`JobIdentityError` says so and names the store as
the likely cause; it never blames a member, since a process without the secret can delete or
replace any record. The ``prefix`` should be fresh for the group (its attempt, its ``init``
call): stale true records under it only slow the agreement until the members' new records
replace them, and never give the members an old identity.
"""

from __future__ import annotations

import hashlib
import secrets
import time

from shardwise.distributed import signed_store

NONCE_BYTES = 32
_LABEL = b"shardwise-job-identity-v1"


class JobIdentityError(RuntimeError):
    """The group's identity records in the store are missing or disagree after the timeout."""


def agree(store, prefix: str, index: int, count: int, secret: bytes, scope: str,
          timeout: float) -> bytes:
    """The identity (32 bytes) that members ``0..count-1`` agree on, as member ``index``.

    Every member calls this with the same ``store``, ``prefix``, ``count``, ``secret`` and
    ``scope``. Two store rounds (nonces, then confirms under the identity; see
    [Note: job identity]); :class:`JobIdentityError` when they do not complete within
    ``timeout`` seconds.
    """
    _check(prefix, index, count, secret, timeout)
    member = _Member(store, prefix, index, count, secret, scope)
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        job_id = member.step()
        if job_id is not None:
            return job_id
        if time.monotonic() > deadline:
            raise JobIdentityError(member.failure(timeout))
        time.sleep(pause)
        pause = min(pause * 1.5, 0.005)  # (as fast as the rest of RPC rendezvous polls)


def _check(prefix: str, index: int, count: int, secret: bytes, timeout: float) -> None:
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"job identity: count must be a positive int, got {count!r}")
    if not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"job identity: index must be in 0..{count - 1}, got {index!r}")
    if not secret:
        raise ValueError("job identity: the secret must not be empty")
    if not prefix:
        raise ValueError("job identity: the prefix must not be empty")
    if not timeout > 0:
        raise ValueError(f"job identity: timeout must be positive, got {timeout!r}")


def identity(scope: str, nonces: list[bytes]) -> bytes:
    """The identity of a group whose members drew ``nonces`` (in member order)."""
    digest = hashlib.sha256(_LABEL)
    digest.update(len(scope.encode()).to_bytes(4, "big") + scope.encode())
    digest.update(len(nonces).to_bytes(4, "big"))
    for nonce in nonces:
        digest.update(nonce)
    return digest.digest()


class _Member:
    """One member's state through the two rounds."""

    def __init__(self, store, prefix: str, index: int, count: int, secret: bytes,
                 scope: str) -> None:
        self.store, self.prefix, self.index, self.count = store, prefix, index, count
        self.secret, self.scope = secret, scope
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.confirmed: bytes | None = None  # the identity this member's confirm names
        self.seen_nonces = self.seen_confirms = 0
        signed_store.put(store, self._key("nonce", index), self.nonce, secret,
                         self._nonce_scope())

    def _key(self, kind: str, member: int) -> str:
        return f"{self.prefix}/{kind}/{member}"

    def _nonce_scope(self) -> str:
        return f"{self.scope}|job-identity/nonce"

    def _confirm_scope(self, job_id: bytes) -> str:
        return f"{self.scope}|job-identity/confirm|{job_id.hex()}"

    def step(self) -> bytes | None:
        """One pass over the store: the identity once every member confirmed it, else None."""
        self._keep(self._key("nonce", self.index), self.nonce, self._nonce_scope())
        nonces = self._nonces()
        self.seen_nonces = sum(n is not None for n in nonces)
        if self.seen_nonces < self.count:
            return None
        job_id = identity(self.scope, nonces)
        confirm_scope = self._confirm_scope(job_id)
        mine = self._key("confirm", self.index)
        if job_id != self.confirmed:
            signed_store.put(self.store, mine, job_id.hex(), self.secret, confirm_scope)
            self.confirmed = job_id
        else:
            self._keep(mine, job_id.hex().encode(), confirm_scope)
        self.seen_confirms = sum(
            m == self.index or signed_store.check(self.store, self._key("confirm", m),
                                                  self.secret, confirm_scope)
            for m in range(self.count))
        return job_id if self.seen_confirms == self.count else None

    def _nonces(self) -> list[bytes | None]:
        found: list[bytes | None] = []
        for m in range(self.count):
            if m == self.index:
                found.append(self.nonce)
                continue
            value = signed_store.get(self.store, self._key("nonce", m), self.secret,
                                     self._nonce_scope())
            found.append(value if value is not None and len(value) == NONCE_BYTES else None)
        return found

    def _keep(self, key: str, value: bytes, scope: str) -> None:
        """Write this member's own record again if it no longer holds (overwritten)."""
        if signed_store.get(self.store, key, self.secret, scope) != value:
            signed_store.put(self.store, key, value, self.secret, scope)

    def failure(self, timeout: float) -> str:
        stage = (f"{self.seen_nonces} of {self.count} nonce records"
                 if self.seen_nonces < self.count
                 else f"{self.seen_confirms} of {self.count} confirm records")
        return (f"job identity under {self.prefix!r}: the store's records are missing or "
                f"disagree after {timeout:g} s ({stage} held for this member); the store may "
                "have been tampered with")
