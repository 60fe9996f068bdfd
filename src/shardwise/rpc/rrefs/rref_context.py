"""Ownership and distributed reference counting of RRefs; RRef ids as capabilities.

[Note: RRef reference counting] The owner keeps an entry per value it owns, holding the value's
future and its *forks*: one per user RRef object alive on another worker, each recorded with the
worker that holds it. The entry stays in the owner's table (and so the value stays alive) while
any fork exists; owner-local RRef objects hold the entry directly, so once the forks are gone
the value lives exactly as long as the owner's own references.

- remote(): the caller makes the RRef id and its own fork id; the owner's thread reading the
  connection creates the entry with that fork before anything later on it is read.
- Sending an RRef to a worker other than its owner creates a fork for the receiver *before* the
  message leaves: the owner adds it locally, or a user asks the owner (FORK_ADD, naming the
  receiver) and waits for the acknowledgement. So the owner has counted the receiver before the
  sender can drop its own reference, including when the receiver is a third worker.
- Sending an RRef to its owner creates no fork: the owner resolves it to its entry while reading
  the message, which arrives before the sender's own later deletion on the same connection.
- A user RRef that is garbage collected queues FORK_DEL; one thread sends the deletions
  (``__del__`` may run on any thread, including a reader that must never send). Graceful
  shutdown flushes the queue and waits for the acknowledgements.

[Note: RRef ids are capabilities] An id is ``(rank, 128 random bits)``, for RRefs and forks
alike, so knowing one is what holding one means, and ids cannot be guessed. The owner also checks
every use against its record of holders, so an id that leaked (a log line, a compromised
process's memory) is still refused to a peer that was never given the RRef:

- FETCH, FORK_ADD, and an RRef unpickled on its owner (a method call through the RRef's proxy,
  ``RRef.backward``, any argument or reply naming it) are served only if the peer holds a fork
  of that RRef. A fork's holder is the worker that made ``remote()``, the receiver the owner
  itself sent it to, or the receiver named in a FORK_ADD from a holder; the owner records the
  fork before its sender may send it (FORK_ADD is acknowledged first), so a receiver that got
  it is known before it can use it.
- FORK_DEL removes a fork only when the peer deleting it is the fork's holder.
- remote() stays one message, as before: the caller proposes the id. The owner refuses an id
  (and a fork id) outside the caller's namespace (its first part is the rank of the
  authenticated connection it came on) or one that already exists, and so never creates an id
  in another worker's name nor hands an existing value to a new creator. With random bits a
  legitimate proposal never collides.

Each refusal is a :class:`ForbiddenRRef` reply to the caller and a warning logged here; the
value and the forks of the legitimate holders are untouched.
"""

from __future__ import annotations

import collections
import logging
import queue
import secrets
import threading
import time
from typing import Any

import torch

from shardwise.rpc.messages import Kind
from shardwise.rpc.trust.serialization import current_session

log = logging.getLogger("shardwise.rpc")

RRefId = tuple[int, int]  # (creating rank, 128 random bits)
ForkId = tuple[int, int]  # (rank that made the fork, 128 random bits)
ID_BITS = 128


class ForbiddenRRef(RuntimeError):
    """A peer used an RRef id or fork id it does not hold, or proposed one this owner refuses
    ([Note: RRef ids are capabilities])."""


class OwnerEntry:
    def __init__(self, rref_id: RRefId):
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: dict[ForkId, int] = {}  # fork -> the rank holding it
        self.holders: collections.Counter[int] = collections.Counter()

    def add(self, fork: ForkId, holder: int) -> None:
        self.forks[fork] = holder
        self.holders[holder] += 1

    def remove(self, fork: ForkId) -> None:
        holder = self.forks.pop(fork)
        self.holders[holder] -= 1
        if not self.holders[holder]:
            del self.holders[holder]


class RRefContext:
    def __init__(self, agent) -> None:
        self._agent = agent
        self._table: dict[RRefId, OwnerEntry] = {}
        self._lock = threading.Lock()
        self._deletes: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: set[torch.futures.Future] = set()
        self._idle = threading.Condition()
        self._queued = 0
        self._closed = False
        self._thread = threading.Thread(target=self._send_deletes, daemon=True,
                                        name="shardwise-rpc-rref-gc")
        self._thread.start()

    # ---------------------------------------------------------------- ids and entries
    def new_id(self) -> tuple[int, int]:
        """A fresh RRef or fork id in this worker's namespace: its rank and 128 random bits."""
        return (self._agent.rank, secrets.randbits(ID_BITS))

    def new_local(self, value: Any) -> OwnerEntry:
        entry = OwnerEntry(self.new_id())
        entry.future.set_result(value)
        return entry

    def _refuse(self, peer: int, message: str) -> ForbiddenRRef:
        """The error sent back to ``peer`` for a refused RRef request, logged here."""
        name = self._agent.workers[peer].name
        log.warning("shardwise.rpc %s: refused an RRef request of %r (rank %d): %s",
                    self._agent.name, name, peer, message)
        return ForbiddenRRef(f"worker {self._agent.name!r} refuses RRef request from {name!r}: "
                             f"{message}")

    def _check_id(self, value: Any, peer: int, what: str) -> tuple[int, int]:
        """``value`` as an id (two ints: a rank of the group, ``ID_BITS`` bits)."""
        if (isinstance(value, (tuple, list)) and len(value) == 2
                and all(type(v) is int for v in value)
                and 0 <= value[0] < self._agent.world_size and 0 <= value[1] < 2 ** ID_BITS):
            return (value[0], value[1])
        raise self._refuse(peer, f"malformed {what} id {value!r:.80}")

    def fields(self, body: Any, count: int, kind: str, peer: int) -> tuple:
        """An RRef request's body as its ``count`` fields."""
        if not isinstance(body, tuple) or len(body) != count:
            raise self._refuse(peer, f"a {kind} request has {count} fields, got {body!r:.80}")
        return body

    def create_owned(self, rref_id: Any, fork: Any, peer: int) -> OwnerEntry:
        """The entry for a ``remote()`` from ``peer``, held by ``peer`` through ``fork``."""
        rref_id = self._check_id(rref_id, peer, "RRef")
        fork = self._check_id(fork, peer, "fork")
        if rref_id[0] != peer or fork[0] != peer:
            raise self._refuse(peer, f"remote() proposed RRef id {rref_id} / fork id {fork} "
                                     "outside its own namespace (the first part must be its "
                                     "rank)")
        with self._lock:
            if rref_id in self._table:
                raise self._refuse(peer, f"remote() proposed RRef id {rref_id}, which exists")
            entry = self._table[rref_id] = OwnerEntry(rref_id)
            entry.add(fork, peer)
            return entry

    def held(self, rref_id: Any, peer: int) -> OwnerEntry:
        """The entry of ``rref_id`` if ``peer`` holds a fork of it, else ForbiddenRRef."""
        rref_id = self._check_id(rref_id, peer, "RRef")
        with self._lock:
            entry = self._table.get(rref_id)
            if entry is not None and entry.holders.get(peer):
                return entry
        raise self._refuse(peer, f"it does not hold RRef {rref_id} (a forged or released id, "
                                 "or one never given to it)")

    def add_fork(self, rref_id: Any, fork: Any, receiver: Any, peer: int) -> None:
        """Count ``fork``, made by ``peer`` for ``receiver``; ``peer`` must hold the RRef."""
        fork = self._check_id(fork, peer, "fork")
        if type(receiver) is not int or not 0 <= receiver < self._agent.world_size \
                or receiver == self._agent.rank or fork[0] != peer:
            raise self._refuse(peer, f"fork {fork} for receiver {receiver!r:.20}: a fork is "
                                     "made by its sender for another worker than the owner")
        entry = self.held(rref_id, peer)
        with self._lock:
            if fork in entry.forks:
                raise self._refuse(peer, f"fork id {fork} exists")
            entry.add(fork, receiver)

    def add_local_fork(self, entry: OwnerEntry, fork: ForkId, receiver: int) -> None:
        with self._lock:
            self._table[entry.rref_id] = entry
            entry.add(fork, receiver)

    def del_fork(self, rref_id: Any, fork: Any, peer: int) -> None:
        """Drop ``fork``, which ``peer`` must hold; the entry goes with its last fork."""
        fork = self._check_id(fork, peer, "fork")
        entry = self.held(rref_id, peer)
        with self._lock:
            if entry.forks.get(fork) != peer:
                raise self._refuse(peer, f"it does not hold fork {fork} of RRef "
                                         f"{entry.rref_id}")
            entry.remove(fork)
            if not entry.forks:
                del self._table[entry.rref_id]

    def owned_count(self) -> int:
        with self._lock:
            return len(self._table)

    # ---------------------------------------------------------------- pickling
    def reduce(self, rref, dest: int) -> tuple:
        from shardwise.rpc.rrefs.rref import rebuild_rref

        if rref._agent is not self._agent:
            raise RuntimeError("an RRef from an RPC agent that has been shut down")
        owner = rref._owner_rank
        if dest == owner:
            return rebuild_rref, (rref._id, owner, None)
        fork = self.new_id()
        if rref.is_owner():
            self.add_local_fork(rref._entry, fork, dest)
        else:  # the owner must count the receiver before this message leaves
            fut = self._agent.request(owner, Kind.FORK_ADD, (rref._id, fork, dest),
                                      self._agent.options.rpc_timeout, "RRef fork")
            current_session().pending.append(fut)
        return rebuild_rref, (rref._id, owner, fork)

    # ---------------------------------------------------------------- deletions
    def user_deleted(self, rref_id: RRefId, owner: int, fork: Any) -> None:
        if self._closed:
            return
        with self._idle:
            self._queued += 1
        self._deletes.put((rref_id, owner, fork))

    def _send_deletes(self) -> None:
        while True:
            item = self._deletes.get()
            if item is None:
                return
            rref_id, owner, fork = item
            fut = self._agent.request(owner, Kind.FORK_DEL, (rref_id, fork),
                                      self._agent.options.rpc_timeout, "RRef deletion")
            with self._idle:
                self._queued -= 1
                self._inflight.add(fut)
            fut.add_done_callback(self._delete_done)

    def _delete_done(self, fut: torch.futures.Future) -> None:
        with self._idle:
            self._inflight.discard(fut)
            self._idle.notify_all()

    def flush(self, timeout: float | None) -> bool:
        """Wait until queued deletions are sent and acknowledged (graceful shutdown); each
        deletion is a call with the RPC timeout, and ``timeout`` (None: none) bounds them all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._queued or self._inflight:
                left = 0.05 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    log.warning("shardwise.rpc: %d RRef deletions unacknowledged at shutdown",
                                self._queued + len(self._inflight))
                    return False
                self._idle.wait(min(left, 0.05))
        return True

    def close(self, join_timeout: float = 5.0) -> None:
        self._closed = True
        self._deletes.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(join_timeout)


# The owner's side of the RRef messages, entries of the agent's handler table (agent.py), called
# as its methods are: in order on the thread reading the connection, checked against the forks
# this owner recorded ([Note: RRef ids are capabilities]); replies go through the agent's pool.
def handle_fetch(agent, peer: int, msg_id: int, ctx_id, body) -> None:
    """FETCH: the value of an RRef ``peer`` holds, sent once its future is done."""
    try:
        (rref_id,) = agent.rrefs.fields(body, 1, "FETCH", peer)
        entry = agent.rrefs.held(rref_id, peer)
    except ForbiddenRRef as exc:
        agent.pool.submit(agent.send_reply, peer, msg_id, None, exc)
        return
    agent.reply_when_done(peer, msg_id, entry.future, ctx_id)


def handle_fork_add(agent, peer: int, msg_id: int, ctx_id, body) -> None:
    """FORK_ADD: count the fork ``peer`` made for a receiver, then acknowledge it."""
    err = None
    try:
        rref_id, fork_id, receiver = agent.rrefs.fields(body, 3, "FORK_ADD", peer)
        agent.rrefs.add_fork(rref_id, fork_id, receiver, peer)
    except ForbiddenRRef as exc:
        err = exc
    agent.pool.submit(agent.send_reply, peer, msg_id, None, err)


def handle_fork_del(agent, peer: int, msg_id: int, ctx_id, body) -> None:
    """FORK_DEL: drop a fork ``peer`` holds, then acknowledge it."""
    err = None
    try:
        rref_id, fork_id = agent.rrefs.fields(body, 2, "FORK_DEL", peer)
        agent.rrefs.del_fork(rref_id, fork_id, peer)
    except ForbiddenRRef as exc:
        err = exc
    agent.pool.submit(agent.send_reply, peer, msg_id, None, err)
