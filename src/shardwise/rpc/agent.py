"""The RPC agent of one worker: sends requests, serves peers, owns the worker's RPC state.

Threads: the thread reading a connection ([Note: reading role] in wire/connection.py: one of its
two readers, or a caller waiting in ``rpc_sync``) decodes frames, completes reply futures and
applies the order-sensitive part of RRef bookkeeping; a call is run by the reader that read it
when the connection's other reader is free to go on reading, else by a pool of
``num_worker_threads`` (workers.py), which also runs every other request and sends its reply;
one thread times calls out (pending.py); one sends RRef deletions (rrefs/rref_context.py).

[Note: shutdown] ``shutdown(graceful=True)``, as torch's: (1) send queued RRef deletions and wait
for this worker's outstanding calls, (2) a store barrier that every worker reaches once its own
calls are done, while all keep serving their peers, (3) close. So a parameter server that calls
``shutdown()`` right after ``init_rpc`` serves its trainers until the last of them shuts down.
Like torch's default (``timeout=0``) the barrier has no time limit; a positive ``timeout`` bounds
it (TimeoutError naming the ranks that never arrived). It still cannot hang on a dead peer: a
worker whose connection is lost before it reached the barrier stops the wait, and shutdown
closes this agent and raises WorkerDied naming it (after waiting for the live ones). A process
that dies closes its sockets at once; a host that vanishes is found by TCP keepalive
(wire/frames.py).

A worker's arrival is told twice: its signed record in the store (signed under the group key,
which holds the group's agreed job id: [Note: group key] in trust/secret.py), and an ``AT_SHUTDOWN``
frame to every live peer over its authenticated connection, sent before it can close that
connection. Either one counts as its arrival: the record serves a peer whose connection to it
is already lost, the frame is evidence that nobody without the secret can delete or
overwrite. So WorkerDied names only a worker that closed its connection without telling its
peers it had called shutdown(): a record deleted from the store, or one replayed over it from
another group, delays no one's shutdown and blames no one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from shardwise.rpc import rendezvous
from shardwise.rpc.autograd.container import AutogradContainer
from shardwise.rpc.functions import check_async_result, is_future
from shardwise.rpc.messages import (
    ENVELOPE,
    REQUESTS,
    Kind,
    decode_exception,
    encode_exception,
)
from shardwise.rpc.options import UNSET_RPC_TIMEOUT, TensorPipeRpcBackendOptions, WorkerInfo
from shardwise.rpc.pending import PendingCall, PendingCalls
from shardwise.rpc.rrefs.rref_context import (
    ForbiddenRRef,
    RRefContext,
    handle_fetch,
    handle_fork_add,
    handle_fork_del,
)
from shardwise.rpc.trust import secret
from shardwise.rpc.trust.callables import qualified_name, resolve
from shardwise.rpc.trust.serialization import Session, dumps, loads
from shardwise.rpc.wire.cuda_transfer import CudaTransfer
from shardwise.rpc.wire.device_maps import (
    DeviceMap,
    check_present,
    inferred_devices,
    inverse,
    local_devices,
    validate_device_maps,
)
from shardwise.rpc.wire.transport import PeerUnavailable, Transport
from shardwise.rpc.workers import WorkerPool

log = logging.getLogger("shardwise.rpc")


class AgentState(Enum):
    RUNNING = "running"
    DRAINING = "draining"  # shutdown barrier: still serving peers
    CLOSED = "closed"


class WorkerDied(RuntimeError):
    """The peer a call was waiting on closed its connection or died."""


class RpcAgent:
    def __init__(self, name: str, rank: int, world_size: int,
                 options: TensorPipeRpcBackendOptions, store: dist.Store,
                 workers: list[WorkerInfo], transport_factory):
        self.name, self.rank, self.world_size = name, rank, world_size
        self.options, self.store = options, store
        self.workers = workers
        self.by_name = {w.name: w for w in workers}
        self.state = AgentState.RUNNING
        self.dead: set[int] = set()
        self.at_shutdown: set[int] = set()  # peers whose connection said: at shutdown
        self.device_maps: dict[str, DeviceMap] = dict(options.device_maps)
        self.peer_devices: list[list[torch.device]] = []  # by rank, as published at init
        self.pending = PendingCalls()
        self._ids = itertools.count(1)
        self._grad_keys = itertools.count(1)
        self.pool = WorkerPool(options.num_worker_threads, f"shardwise-rpc-{name}")
        self.rrefs = RRefContext(self)
        self.autograd = AutogradContainer(self)
        self.cuda = CudaTransfer(self)
        self.transport: Transport = transport_factory(self._on_frame, self._on_lost)

    # ----------------------------------------------------------------- addressing
    def worker(self, to: str | int | WorkerInfo) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            return to
        if isinstance(to, str):
            if to not in self.by_name:
                raise ValueError(f"unknown RPC worker {to!r}; workers: {sorted(self.by_name)}")
            return self.by_name[to]
        if isinstance(to, int) and 0 <= to < self.world_size:
            return self.workers[to]
        raise ValueError(f"unknown RPC worker {to!r} (a name, a rank or a WorkerInfo)")

    def timeout_of(self, timeout: float) -> float:
        return self.options.rpc_timeout if timeout == UNSET_RPC_TIMEOUT else float(timeout)

    # ----------------------------------------------------------------- calls
    def call(self, to, func, args, kwargs, timeout: float) -> torch.futures.Future:
        dest = self.worker(to).id
        fname = qualified_name(func)
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if dest == self.rank:
            return self._run_local(func, args, kwargs)
        body = (fname, args, kwargs, self.reply_map(dest))
        return self.request(dest, Kind.CALL, body, self.timeout_of(timeout),
                            f"rpc to {self.workers[dest].name!r} ({fname})")

    def reply_map(self, dest: int) -> DeviceMap | None:
        """The map the callee applies to its results: the inverse of ours to it."""
        device_map = self.device_maps.get(self.workers[dest].name)
        return inverse(device_map) if device_map else None

    def _run_local(self, func, args, kwargs) -> torch.futures.Future:
        fut = torch.futures.Future()
        ctx_id = self.autograd.current_id()

        def run() -> None:
            try:
                with self.autograd.bound(ctx_id):
                    result = func(*args, **kwargs)
                check_async_result(func, result)
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                fut.set_exception(exc)
                return
            if is_future(result):
                result.add_done_callback(lambda f: _copy_future(f, fut))
            else:
                fut.set_result(result)

        self.pool.submit(run)
        return fut

    def wait_reply(self, to, fut: torch.futures.Future) -> None:
        """Wait for ``fut`` (a call to ``to``) reading the connection to ``to`` on this thread
        where no other thread reads it ([Note: reading role] in wire/connection.py)."""
        dest = self.worker(to).id
        if dest != self.rank and not fut.done():
            self.transport.wait_reply(dest, fut)

    def request(self, dest: int, kind: Kind, body: Any, timeout: float, what: str,
                ctx_id: int | None = None) -> torch.futures.Future:
        """Send a request; the future completes with the reply (or the error)."""
        fut = torch.futures.Future()
        if self.state is AgentState.CLOSED:
            fut.set_exception(RuntimeError("RPC agent is shut down"))
            return fut
        if dest in self.dead:
            fut.set_exception(WorkerDied(f"{what}: worker {self.workers[dest].name!r} "
                                         f"(rank {dest}) is dead"))
            return fut
        msg_id = next(self._ids)
        if ctx_id is None and kind in (Kind.CALL, Kind.REMOTE, Kind.FETCH):
            ctx_id = self.autograd.current_id()
        try:
            payload, buffers, session = self._encode(kind, msg_id, body, dest, ctx_id)
        except BaseException as exc:  # noqa: BLE001
            fut.set_exception(exc)
            return fut
        self.pending.add(msg_id, PendingCall(fut, dest, what, timeout, keep=buffers))
        try:
            self.transport.send(dest, payload, buffers)
        except (PeerUnavailable, OSError) as exc:
            if self.pending.pop(msg_id) is not None:
                fut.set_exception(WorkerDied(f"{what}: cannot reach worker "
                                             f"{self.workers[dest].name!r}: {exc}"))
        return fut

    def _encode(self, kind: int, msg_id: int, body: Any, dest: int, ctx_id: int | None):
        session = Session(self, dest)
        grad_key = next(self._grad_keys) if ctx_id is not None else None
        pickled, buffers = dumps((ctx_id, grad_key, body), session)
        for fut in session.pending:  # RRef forks being registered with their owners
            fut.wait()
        if ctx_id is not None and session.grad_tensors:
            self.autograd.record_send(ctx_id, grad_key, session.grad_tensors, dest)
        elif ctx_id is not None:
            self.autograd.note_peer(ctx_id, dest)
        return ENVELOPE.pack(kind, msg_id) + pickled, buffers, session

    # ----------------------------------------------------------------- receiving
    def _on_frame(self, peer: int, payload: bytearray, buffers: list) -> Callable[[], None] | None:
        """A frame from ``peer``, on the thread reading its connection: replies complete their
        futures here; a call is returned to be run by that thread or the pool ([Note: reading
        role] in wire/connection.py), other requests go to the pool."""
        kind, msg_id = ENVELOPE.unpack_from(payload)
        body = memoryview(payload)[ENVELOPE.size:]
        if kind in (Kind.RESPONSE, Kind.ERROR):
            self._on_reply(peer, kind, msg_id, body, buffers)
            return None
        if kind == Kind.AT_SHUTDOWN:  # here, before the connection's loss is handled
            self.at_shutdown.add(peer)
            return None
        if kind in REQUESTS:
            return self._on_request(peer, Kind(kind), msg_id, body, buffers)
        else:
            raise ValueError(f"unknown message kind {kind} from rank {peer}")

    def _decode(self, peer: int, body: memoryview, buffers: list) -> tuple:
        session = Session(self, peer)
        ctx_id, grad_key, value = loads(body, buffers, session)
        if ctx_id is not None and session.grad_tensors:
            self.autograd.record_recv(ctx_id, (peer, grad_key), session.grad_tensors, peer)
        return ctx_id, value

    def _on_reply(self, peer: int, kind: int, msg_id: int, body, buffers) -> None:
        call = self.pending.pop(msg_id)
        if call is None:
            return  # timed out or failed already
        try:
            _, value = self._decode(peer, body, buffers)
        except Exception as exc:  # noqa: BLE001
            call.fut.set_exception(RuntimeError(f"{call.what}: could not decode the reply: "
                                                f"{type(exc).__name__}: {exc}"))
            return
        if kind == Kind.ERROR:
            call.fut.set_exception(decode_exception(value, self.workers[peer].name))
        else:
            call.fut.set_result(value)

    def _on_request(self, peer: int, kind: Kind, msg_id: int, body, buffers
                    ) -> Callable[[], None] | None:
        try:
            ctx_id, value = self._decode(peer, body, buffers)
        except Exception as exc:  # noqa: BLE001 - e.g. a forbidden global: answer, keep serving
            log.warning("shardwise.rpc %s: cannot decode %s request from %s: %s", self.name,
                        kind.name, self.workers[peer].name, exc)
            self.pool.submit(self.send_reply, peer, msg_id, None, exc)
            return None
        handler = self._handlers[kind]
        return handler(self, peer, msg_id, ctx_id, value)

    def _handle_call(self, peer: int, msg_id: int, ctx_id, body) -> Callable[[], None]:
        return functools.partial(self._run_and_reply, peer, msg_id, ctx_id, body)

    def _run_and_reply(self, peer: int, msg_id: int, ctx_id, body) -> None:
        fname, args, kwargs, reply_map = body
        try:
            func = resolve(fname)
            with self.autograd.bound(ctx_id), self.cuda.reply_map(peer, reply_map):
                result = func(*args, **kwargs)
            check_async_result(func, result)
        except BaseException as exc:  # noqa: BLE001 - sent to the caller
            self.send_reply(peer, msg_id, None, exc, ctx_id, reply_map)
            return
        if is_future(result):
            self.reply_when_done(peer, msg_id, result, ctx_id, reply_map)
        else:
            self.send_reply(peer, msg_id, result, None, ctx_id, reply_map)

    def reply_when_done(self, peer: int, msg_id: int, fut: torch.futures.Future,
                        ctx_id=None, reply_map=None, transform=None) -> None:
        """Reply with ``fut``'s value once it completes (sent from the pool, never inline)."""
        def done(f: torch.futures.Future) -> None:
            try:
                value = f.value()
                if transform is not None:
                    value = transform(value)
            except BaseException as exc:  # noqa: BLE001
                self.pool.submit(self.send_reply, peer, msg_id, None, exc, ctx_id, reply_map)
                return
            self.pool.submit(self.send_reply, peer, msg_id, value, None, ctx_id, reply_map)

        fut.add_done_callback(done)

    def send_reply(self, peer: int, msg_id: int, value: Any, exc: BaseException | None,
                    ctx_id: int | None = None, reply_map: DeviceMap | None = None) -> None:
        kind = Kind.RESPONSE if exc is None else Kind.ERROR
        try:
            with self.cuda.reply_map(peer, reply_map):
                payload, buffers, _ = self._encode(
                    kind, msg_id, value if exc is None else encode_exception(exc), peer, ctx_id)
        except BaseException as enc_exc:  # noqa: BLE001 - e.g. an unpicklable result
            kind, ctx_id = Kind.ERROR, None
            payload, buffers, _ = self._encode(kind, msg_id, encode_exception(enc_exc), peer,
                                               None)
        try:
            self.transport.send(peer, payload, buffers)
        except (PeerUnavailable, OSError) as send_exc:
            log.debug("shardwise.rpc %s: reply to rank %d not sent: %s", self.name, peer,
                      send_exc)

    def _handle_remote(self, peer: int, msg_id: int, ctx_id, body) -> None:
        try:  # in order, on the thread reading the connection
            fields = self.rrefs.fields(body, 6, "REMOTE", peer)
            fname, args, kwargs, reply_map, rref_id, fork_id = fields
            entry = self.rrefs.create_owned(rref_id, fork_id, peer)
        except ForbiddenRRef as exc:
            self.pool.submit(self.send_reply, peer, msg_id, None, exc)
            return

        def run() -> None:
            try:
                func = resolve(fname)
                with self.autograd.bound(ctx_id), self.cuda.reply_map(peer, reply_map):
                    result = func(*args, **kwargs)
                check_async_result(func, result)
            except BaseException as exc:  # noqa: BLE001
                entry.future.set_exception(exc)
                self.send_reply(peer, msg_id, None, exc)
                return
            if is_future(result):
                result.add_done_callback(lambda f: _copy_future(f, entry.future))
            else:
                entry.future.set_result(result)
            self.send_reply(peer, msg_id, None, None)

        self.pool.submit(run)

    def _handle_backward(self, peer: int, msg_id: int, ctx_id, body) -> None:
        def run() -> None:
            try:
                fut = self.autograd.on_backward(*body)
            except BaseException as exc:  # noqa: BLE001
                self.send_reply(peer, msg_id, None, exc)
                return
            self.reply_when_done(peer, msg_id, fut, transform=lambda _: None)

        self.pool.submit(run)

    def _handle_ctx_release(self, peer: int, msg_id: int, ctx_id, body) -> None:
        def run() -> None:
            self.autograd.release(body[0], origin=peer)
            self.send_reply(peer, msg_id, None, None)

        self.pool.submit(run)

    _handlers = {
        Kind.CALL: _handle_call, Kind.REMOTE: _handle_remote, Kind.FETCH: handle_fetch,
        Kind.FORK_ADD: handle_fork_add, Kind.FORK_DEL: handle_fork_del,  # in rref_context.py
        Kind.BACKWARD: _handle_backward, Kind.CTX_RELEASE: _handle_ctx_release,
    }

    # ----------------------------------------------------------------- serialization hooks
    def reduce_rref(self, rref: Any, dest: int) -> tuple:
        return self.rrefs.reduce(rref, dest)

    def reduce_cuda_tensor(self, tensor: torch.Tensor, dest: int) -> tuple:
        return self.cuda.reduce(tensor, dest)

    # ----------------------------------------------------------------- failures, shutdown
    def _on_lost(self, peer: int, exc: BaseException, clean: bool) -> None:
        self.dead.add(peer)
        name = self.workers[peer].name
        if self.state is AgentState.RUNNING:
            log.error("shardwise.rpc %s: lost worker %r (rank %d): %s", self.name, name, peer,
                      exc)
        else:
            log.debug("shardwise.rpc %s: rank %d left (%s)", self.name, peer, exc)
        self.pending.fail_peer(peer, lambda call: WorkerDied(
            f"{call.what}: worker {name!r} (rank {peer}) died or closed its connection "
            f"({type(exc).__name__}: {exc})"))

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Leave the group ([Note: shutdown]). ``timeout`` None: ``options.shutdown_timeout``;
        0 (given or from the options): no limit."""
        if self.state is AgentState.CLOSED:
            return
        timeout = self.options.shutdown_timeout if timeout is None else float(timeout)
        try:
            if graceful:
                self._drain(timeout if timeout > 0 else None)
        finally:  # closed also when the barrier reports a dead or late worker
            self.state = AgentState.CLOSED
            self.pending.fail_all(lambda call: RuntimeError(f"{call.what}: RPC agent shut down"))
            self.rrefs.close()
            self.transport.close()
            self.pending.close()
            self.pool.shutdown()
            self.pool.join(5.0)
            # the store RPC hosted (rank 0 without a launcher) closes with its last reference
            self.store = None

    def _drain(self, limit: float | None) -> None:
        deadline = None if limit is None else time.monotonic() + limit

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        self.rrefs.flush(left())
        if not self.pending.wait_empty(left()):
            log.warning("shardwise.rpc %s: %d calls still outstanding at shutdown",
                        self.name, self.pending.count())
        self.state = AgentState.DRAINING
        key = self.transport.group_key  # records signed ([Note: signed store records])
        self._tell_at_shutdown()
        try:
            missing = rendezvous.barrier(self.store, "shutdown", self.rank, self.world_size,
                                         left(), key, dead=lambda: set(self.dead),
                                         told=lambda: set(self.at_shutdown))
            # the store's host (rank 0 without a launcher) stays until everyone has read it,
            # then closes it: the others only say they are done and never read it again
            if self.rank == 0:
                rendezvous.barrier(self.store, "left", self.rank, self.world_size, left(), key,
                                   dead=lambda: set(self.dead) | set(missing),
                                   keep=("shutdown",))
            else:
                rendezvous.arrive(self.store, "left", self.rank, key)
        except (RuntimeError, OSError, dist.DistStoreError) as exc:  # store host gone
            raise rendezvous.RendezvousError(
                f"shutdown on {self.name!r}: lost the rendezvous store while waiting for the "
                f"other workers ({type(exc).__name__}: {exc})") from exc
        died = [r for r in missing if r in self.dead]
        if died:
            names = ", ".join(f"{self.workers[r].name!r} (rank {r})" for r in died)
            raise WorkerDied(f"shutdown on {self.name!r}: worker {names} died before calling "
                             "shutdown(); this worker has shut down")
        if missing:
            raise TimeoutError(f"shutdown on {self.name!r}: ranks {missing} did not call "
                               f"shutdown() within {limit:g} s; this worker has shut down")

    def _tell_at_shutdown(self) -> None:
        """Tell every live peer over its connection that this worker is at the shutdown
        barrier ([Note: shutdown]); a peer that cannot be reached is found dead anyway."""
        frame = ENVELOPE.pack(Kind.AT_SHUTDOWN, 0)
        for peer in range(self.world_size):
            if peer != self.rank and peer not in self.dead:
                with contextlib.suppress(PeerUnavailable, OSError):
                    self.transport.send(peer, frame, [])


def _copy_future(src: torch.futures.Future, dst: torch.futures.Future) -> None:
    try:
        dst.set_result(src.value())
    except BaseException as exc:  # noqa: BLE001
        with contextlib.suppress(RuntimeError):
            dst.set_exception(exc)


def start_agent(name: str, rank: int, world_size: int, options: TensorPipeRpcBackendOptions,
                publish=None) -> RpcAgent:
    """Rendezvous, connect to every peer, check device maps, and return a running agent."""
    devices = local_devices(options.devices, options.device_maps)  # bad maps fail before
    raw_store = options.store or rendezvous.make_store(
        options.init_method, rank, world_size, options.connect_timeout)
    store = rendezvous.scoped(raw_store)
    token, secret_file = secret.group_key(store, rank, world_size, _address(raw_store),
                                          options.connect_timeout)
    try:  # the secret file (one host, no $SHARDWISE_RPC_SECRET) goes once all connected
        return _start(name, rank, world_size, options, store, token, devices, publish)
    finally:
        secret.remove(secret_file)


def _start(name, rank, world_size, options, store, token, devices, publish) -> RpcAgent:
    where = rendezvous.store_host(options.store) if options.store else \
        _store_host(options.init_method)
    host = rendezvous.advertised_host(where)
    holder: dict[str, Transport] = {}

    def factory(on_frame, on_lost) -> Transport:
        holder["t"] = Transport(rank, world_size, token, host, on_frame, on_lost,
                                handshake_timeout=options.handshake_timeout,
                                max_message=options.max_message_size,
                                defer=lambda fn: holder["agent"].pool.submit(fn))
        return holder["t"]

    # the transport must listen before the address is published, so build it first
    transport = factory(lambda *a: holder["agent"]._on_frame(*a),
                        lambda *a: holder["agent"]._on_lost(*a))
    record = {"name": name, "host": host, "port": transport.port,
              "devices": [str(d) for d in devices], "explicit": options.devices is not None,
              "maps": {peer: {str(k): str(v) for k, v in m.items()}
                       for peer, m in options.device_maps.items()}}
    try:
        records = rendezvous.exchange(store, rank, world_size, record, options.connect_timeout,
                                      token)
        every = inferred_devices(records)
        check_present(every[name], name)
        validate_device_maps(options.device_maps, every[name], every, name)
    except BaseException:
        transport.close()
        raise
    workers = [WorkerInfo(r["name"], i) for i, r in enumerate(records)]
    agent = RpcAgent(name, rank, world_size, options, store, workers, lambda *_: transport)
    holder["agent"] = agent
    agent.peer_devices = [every[r["name"]] for r in records]
    agent.cuda.set_peer_hosts([r["host"] for r in records])
    if publish is not None:  # current before any peer can call in: RRef() needs it
        publish(agent)
    try:
        for peer in range(rank):
            transport.connect(peer, records[peer]["host"], records[peer]["port"],
                              options.connect_timeout)
        transport.wait_connected([p for p in range(world_size) if p != rank],
                                 options.connect_timeout)
        missing = rendezvous.barrier(store, "ready", rank, world_size, options.connect_timeout,
                                     token)
        if missing:
            raise rendezvous.RendezvousError(f"ranks {missing} did not finish connecting")
    except BaseException:
        agent.shutdown(graceful=False)
        if publish is not None:
            publish(None)
        raise
    return agent


def _address(store: dist.Store) -> str:
    """host:port of the store (names the one-host secret file), unwrapped from prefixes."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


def _store_host(init_method: str) -> str | None:
    try:
        return rendezvous._store_address(init_method)[0]
    except rendezvous.RendezvousError:
        return None
