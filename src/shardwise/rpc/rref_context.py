"""Ownership and distributed reference counting of RRefs.

[Note: RRef reference counting] The owner keeps an entry per value it owns, holding the value's
future and the set of *forks*: one id per user RRef object alive on another worker. The entry
stays in the owner's table (and so the value stays alive) while any fork exists; owner-local
RRef objects hold the entry directly, so once the forks are gone the value lives exactly as long
as the owner's own references.

- remote(): the caller makes the RRef id and its own fork id; the owner's thread reading the
  connection creates the entry with that fork before anything later on it is read.
- Sending an RRef to a worker other than its owner creates a fork for the receiver *before* the
  message leaves: the owner adds it locally, or a user asks the owner (FORK_ADD) and waits for
  the acknowledgement. So the owner has counted the receiver before the sender can drop its
  own reference, including when the receiver is a third worker.
- Sending an RRef to its owner creates no fork: the owner resolves it to its entry while reading
  the message, which arrives before the sender's own later deletion on the same connection.
- A user RRef that is garbage collected queues FORK_DEL; one thread sends the deletions
  (``__del__`` may run on any thread, including a reader that must never send). Graceful
  shutdown flushes the queue and waits for the acknowledgements.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any

import torch

from shardwise.rpc.messages import Kind
from shardwise.rpc.serialization import current_session

log = logging.getLogger("shardwise.rpc")

RRefId = tuple[int, int]  # (creating rank, counter)
ForkId = tuple[int, int]  # (rank that made the fork, counter)


class OwnerEntry:
    def __init__(self, rref_id: RRefId):
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: set[Any] = set()


class RRefContext:
    def __init__(self, agent) -> None:
        self._agent = agent
        self._table: dict[RRefId, OwnerEntry] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
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
        return (self._agent.rank, next(self._ids))

    def new_local(self, value: Any) -> OwnerEntry:
        entry = OwnerEntry(self.new_id())
        entry.future.set_result(value)
        return entry

    def create_owned(self, rref_id: RRefId, fork: Any) -> OwnerEntry:
        with self._lock:
            entry = self._table.get(rref_id)
            if entry is None:
                entry = self._table[rref_id] = OwnerEntry(rref_id)
            entry.forks.add(fork)
            return entry

    def owned(self, rref_id: RRefId) -> OwnerEntry | None:
        with self._lock:
            return self._table.get(tuple(rref_id))

    def add_fork(self, rref_id: RRefId, fork: Any) -> BaseException | None:
        with self._lock:
            entry = self._table.get(tuple(rref_id))
            if entry is None:
                return RuntimeError(f"worker {self._agent.name!r} owns no RRef {rref_id}")
            entry.forks.add(tuple(fork))
            return None

    def add_local_fork(self, entry: OwnerEntry, fork: Any) -> None:
        with self._lock:
            self._table[entry.rref_id] = entry
            entry.forks.add(fork)

    def del_fork(self, rref_id: RRefId, fork: Any) -> None:
        with self._lock:
            entry = self._table.get(tuple(rref_id))
            if entry is None:
                return
            entry.forks.discard(tuple(fork))
            if not entry.forks:
                del self._table[entry.rref_id]

    def owned_count(self) -> int:
        with self._lock:
            return len(self._table)

    # ---------------------------------------------------------------- pickling
    def is_rref(self, obj: Any) -> bool:
        from shardwise.rpc.rref import RRef

        return isinstance(obj, RRef)

    def reduce(self, rref, dest: int) -> tuple:
        from shardwise.rpc.rref import rebuild_rref

        if rref._agent is not self._agent:
            raise RuntimeError("an RRef from an RPC agent that has been shut down")
        owner = rref._owner_rank
        if dest == owner:
            return rebuild_rref, (rref._id, owner, None)
        fork = (self._agent.rank, next(self._ids))
        if rref.is_owner():
            self.add_local_fork(rref._entry, fork)
        else:  # the owner must count the receiver before this message leaves
            fut = self._agent.request(owner, Kind.FORK_ADD, (rref._id, fork),
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
