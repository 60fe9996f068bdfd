"""Functions the RPC tests call on remote workers (importable by name on every worker)."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import torch
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc.current import get_agent

STOP = threading.Event()
_held: list = []


def stop() -> None:
    STOP.set()


def echo(*args, **kwargs):
    return args, kwargs


def identity(x):
    return x


def add(a, b=1, *, scale=1):
    return (a + b) * scale


def boom(message: str) -> None:
    raise ValueError(message)


def sleep_then(seconds: float, value=None):
    time.sleep(seconds)
    return value


def die_soon(after: float) -> None:
    threading.Timer(after, os._exit, args=(3,)).start()
    time.sleep(60)


def my_port() -> int:
    return get_agent().transport.port


def my_name() -> str:
    return rpc.get_worker_info().name


def call_other(to: str, func, args=()):
    return rpc.rpc_sync(to, func, args=args)


class Tracked:
    """Counts live instances on this worker (the RRef lifetime tests read the count)."""

    live = 0

    def __init__(self, value):
        self.value = value
        Tracked.live += 1

    def __del__(self):
        Tracked.live -= 1

    def get(self):
        return self.value

    def add(self, x, *, times=1):
        return self.value + x * times


def live_tracked() -> int:
    gc.collect()
    return Tracked.live


def hold(rref) -> str:
    _held.append(rref)
    return rref.owner_name()


def pass_on(rref, to: str) -> str:
    """Fork a user RRef this worker holds to another worker."""
    return rpc.rpc_sync(to, hold, args=(rref,))


def drop_held() -> None:
    _held.clear()
    gc.collect()
    get_agent().rrefs.flush(10.0)


def fetch_held(index: int):
    return _held[index].to_here()


def make_rref(value):
    return rpc.RRef(Tracked(value))


def owned_count() -> int:
    return get_agent().rrefs.owned_count()


def rref_value(rref):
    return rref.to_here()


def is_owner_here(rref) -> bool:
    return rref.is_owner()


# ---------------------------------------------------------------- RRef forgery (the victim's side)
_victim: dict = {}


def victim_makes(owner: str, value: float) -> tuple:
    """A legitimate ``remote()`` of ``full((2,), value)`` on ``owner``, kept here; returns the
    RRef's id and its fork's id, the ids an attacker is assumed to have learnt."""
    rref = rpc.remote(owner, torch.full, args=((2,), value))
    rref.to_here()
    _victim["rref"] = rref
    return rref._id, rref._fork


def victim_reads():
    return _victim["rref"].to_here()


def victim_remote_value(owner: str, value: float):
    """A fresh ``remote()`` of ``full((2,), value)`` on ``owner``, fetched back."""
    return rpc.remote(owner, torch.full, args=((2,), value)).to_here()


def victim_drops() -> None:
    _victim.clear()
    gc.collect()
    get_agent().rrefs.flush(10.0)


# ---------------------------------------------------------------- autograd and optimizer
def make_linear(seed: int, n_in: int, n_out: int) -> nn.Module:
    """The same weights for a seed in whichever thread (RPC threads build models concurrently,
    and torch.manual_seed would let them draw from each other's seeds)."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(n_in, n_out)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return model


def param_rrefs(module_rref) -> list:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def state_of(module_rref) -> dict:
    return {k: v.detach().clone() for k, v in module_rref.local_value().state_dict().items()}


def grads_of(module_rref, context_id: int) -> dict:
    grads = rpc.autograd.get_gradients(context_id)
    return {n: grads[p] for n, p in module_rref.local_value().named_parameters() if p in grads}


def forward(module_rref, x):
    return module_rref.local_value()(x)


def nested_square(t, via: str):
    """t + (t * t computed on ``via``): a nested RPC inside a distributed autograd context."""
    return t + rpc.rpc_sync(via, torch.mul, args=(t, t))


def pass_on_held(index: int, to: str) -> str:
    return rpc.rpc_sync(to, hold, args=(_held[index],))


_kept: list = []


def make_and_keep(value):
    rref = rpc.RRef(Tracked(value))
    _kept.append(rref)
    return rref


def drop_kept() -> None:
    _kept.clear()
    gc.collect()


def forward_rref(module_rref, x_rref):
    """A pipeline stage: fetch the input from wherever it lives, run the local module."""
    return module_rref.local_value()(x_rref.to_here())


def params_are(module_rref, param_rrefs) -> bool:
    mine = list(module_rref.local_value().parameters())
    return all(r.local_value() is p for r, p in zip(param_rrefs, mine))


_meetings: dict[str, threading.Barrier] = {}
_meetings_lock = threading.Lock()


def meet(key: str, parties: int) -> int:
    """Block until ``parties`` calls with this key are running here at once (RPC pool threads)."""
    with _meetings_lock:
        barrier = _meetings.setdefault(key, threading.Barrier(parties, timeout=30))
    return barrier.wait()


# ---------------------------------------------------------------- async_execution
@rpc.functions.async_execution
def async_add_then(to: str, x, y, z):
    """torch's docs' example: a nested RPC whose ``.then`` future is the reply."""
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_collect(to: str, xs):
    """``collect_all`` of several RPCs, summed in ``.then`` (a plain torch._C.Future)."""
    futs = [rpc.rpc_async(to, torch.mul, args=(x, 2)) for x in xs]
    return torch.futures.collect_all(futs).then(lambda f: sum(g.wait() for g in f.wait()))


@rpc.functions.async_execution
def async_not_a_future(x):
    return x


@rpc.functions.async_execution
def async_fails(message: str):
    fut = torch.futures.Future()
    fut.set_exception(ValueError(message))
    return fut


class AsyncOps:
    """async_execution on a staticmethod, a classmethod and a method (torch's docs)."""

    @staticmethod
    @rpc.functions.async_execution
    def static_add(to: str, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_add(cls, to: str, x, y, z):
        out = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: out.set_result(fut.wait() + z))
        return out

    @rpc.functions.async_execution
    def bound_add(self, to: str, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class BatchSum:
    """The batch-update pattern: every caller gets the same pending future; the call that
    completes a batch of ``size`` sets its result to the batch's sum."""

    def __init__(self, size: int):
        self.size, self.lock = size, threading.Lock()
        self.items: list = []
        self.future = torch.futures.Future()

    @staticmethod
    @rpc.functions.async_execution
    def add(batch_rref, x):
        self = batch_rref.local_value()
        with self.lock:
            self.items.append(x)
            fut = self.future
            if len(self.items) == self.size:
                total = sum(self.items)
                self.items, self.future = [], torch.futures.Future()
                fut.set_result(total)
        return fut.then(lambda f: f.wait() * 1)


def scalar_loss(x, w):
    return (x * w).sum()


def remote_module_forward(remote_module, x):
    """A RemoteModule received in an RPC, used on this worker."""
    return remote_module(x), remote_module.forward_async(x).wait()


def remote_module_owner(remote_module) -> str:
    return remote_module.get_module_rref().owner_name()


# ---------------------------------------------------------------- method allow-list
def write_marker(*args) -> None:
    """Writes "ran" to the path in its last argument: what an attacker wants a worker to run
    (test_method_allow_list names it where a class is expected)."""
    with open(args[-1], "w") as f:
        f.write("ran")


def ndarray_of(n: int) -> np.ndarray:
    """A library object (numpy array) owned by this worker, for RRef method tests."""
    return np.arange(n, dtype=np.uint8)


def local_backward_of_owned(x):
    """An owner RRef of a scalar, backward without a distributed context: ``.grad``."""
    leaf = x.detach().requires_grad_()
    rpc.RRef((leaf * leaf).sum()).backward()
    return leaf.grad


class ImportDottedSystem:
    """Pickles as ``torch._utils._import_dotted_name("os.system")``: the first half of the
    ``__reduce__`` chain an attacker uses to reach ``os.system`` through an allowed-looking
    torch helper."""

    def __reduce__(self):
        return torch._utils._import_dotted_name, ("os.system",)

    def __call__(self, *args):  # (pickle wants a callable; this one never runs here)
        raise AssertionError("not called locally")


class RunsShell:
    """Pickles as ``os.system(command)`` reached through :class:`ImportDottedSystem`."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return ImportDottedSystem(), (self.command,)


def evil_reply(command: str) -> RunsShell:
    """A compromised callee: its reply, unpickled by the caller, would run ``command``."""
    return RunsShell(command)


def resources() -> tuple[int, int, int]:
    """This worker's thread count, open file descriptors and resident memory (bytes)."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return threading.active_count(), len(os.listdir("/proc/self/fd")), \
        rss_pages * os.sysconf("SC_PAGE_SIZE")


def listener_address() -> tuple[str, int]:
    return get_agent().transport._listener.getsockname()[:2]


def channel_kinds() -> list[str]:
    """The class of each of this worker's connections (TCP or shared memory)."""
    return [type(c).__name__ for c in get_agent().transport.conns.values()]


def many_large(count: int, numel: int) -> list:
    """``count`` distinct large tensors at once (more than a shared-memory pool holds)."""
    return [torch.full((numel,), float(i)) for i in range(count)]


def shm_sent(to: str) -> tuple[int, int]:
    """Large buffers this worker sent to ``to`` through the pool and through segments."""
    conn = get_agent().transport.conns[get_agent().worker(to).id]
    return conn.sent_lent, conn.sent_segments


# every worker that imports this module lets its peers call the functions above (shardwise
# resolves only allowed names: [Note: allow-list] in shardwise/rpc/trust/callables.py)
rpc.register_module(__name__)


def make_netlike(seed: int) -> nn.Module:
    """A model of tests.rpc.netlike (a library module nobody registered), imported here."""
    from tests.rpc import netlike

    return netlike.make(seed)
