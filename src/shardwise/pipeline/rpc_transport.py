"""The RPC transport: activations go forward as RPCs inside one distributed autograd context per
micro-batch, and ``shardwise.rpc.autograd.backward`` takes the gradients back through them.

[Note: pipeline over RPC] Stage 0 opens a context for micro-batch j when it runs forward j. Each
stage sends its output to the next stage's mailbox with ``rpc_async`` while bound to context j,
so the tensor is recorded as sent (here) and received (there) in that context, and the next
stage's forward, run on its own schedule thread, builds on the received leaf. Backward j is run
by the last stage: ``backward(cid_j, [loss_j])`` returns once every stage's part of the graph
has run (the RPC engine sends the gradients back hop by hop). The last stage then tells the
other stages, last-but-one down to stage 0, that micro-batch j is done; each reads its
gradients from context j in that call and queues them for its schedule thread. Then the last
stage releases context j on itself and, one RPC each, on every earlier stage (freeing the
graphs, so 1F1B keeps few micro-batches alive; a worker that holds several stages, as in
interleaved schedules, is told once and releases once); an earlier stage's backward action for
j returns once both its gradients and that release have arrived. A worker's gradients in a
context are those of all its stages; each stage keeps its own parameters'. Gradients are summed per
parameter over the step and put into ``.grad`` by one local ``torch.autograd.backward`` from the
parameters, so a stage wrapped in DistributedDataParallel reduces exactly once per step.

The RPC rank of every stage's worker must equal its c10d global rank. Binding a thread to an
existing context has no public call in ``shardwise.rpc.autograd`` yet; ``_contexts()`` below
uses the agent's container for that (new, bind, release), in this one place.
"""

from __future__ import annotations

import threading
import time

import torch

import shardwise.rpc as rpc
from shardwise.distributed.timeouts import default_timeout
from shardwise.rpc import autograd as dist_autograd
from shardwise.rpc.trust.callables import register

_boxes: dict[str, _Mailbox] = {}
_boxes_lock = threading.Lock()


class _Mailbox:
    """Items delivered by peers, keyed by (kind, micro-batch), taken once by the schedule."""

    def __init__(self) -> None:
        self._items: dict[tuple, object] = {}
        self._cond = threading.Condition()

    def put(self, key: tuple, item: object) -> None:
        with self._cond:
            if key in self._items:  # never overwrite: the first item would be lost
                raise RuntimeError(f"pipeline mailbox: {key} delivered twice")
            self._items[key] = item
            self._cond.notify_all()

    def take(self, key: tuple, what: str) -> object:
        timeout = default_timeout().total_seconds()
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"pipeline stage waited {timeout:g} s for {what}")
                self._cond.wait(left)
            return self._items.pop(key)


def _box(key: str) -> _Mailbox:
    with _boxes_lock:
        return _boxes.setdefault(key, _Mailbox())


@register
def deliver_activation(box: str, rnd: int, micro: int, context_id: int,
                       x: torch.Tensor) -> None:
    """Run by RPC on the next stage: queue micro-batch ``micro``'s input of round ``rnd``."""
    _box(box).put(("F", rnd, micro), (context_id, x))


@register
def backward_done(box: str, rnd: int, micro: int, context_id: int) -> None:
    """Run by RPC on an earlier stage: keep this worker's gradients of micro-batch ``micro``."""
    _box(box).put(("G", rnd, micro), dist_autograd.get_gradients(context_id))


@register
def release_here(boxes: list[str], rnd: int, micro: int, context_id: int) -> None:
    """Run by RPC on a worker of earlier stages once every stage has its gradients: free the
    context (its graph) here, once however many stages the worker holds, then let each of those
    stages' schedules go on."""
    _contexts().release(context_id)  # peers that still hold it are told; not waited for here
    for box in boxes:
        _box(box).put(("B", rnd, micro), None)


def _contexts():
    from shardwise.rpc.current import get_agent

    return get_agent().autograd


class RpcRuntime:
    """One stage's side of [Note: pipeline over RPC]."""

    def __init__(self, name: str, stage_index: int, num_stages: int, ranks: list[int]):
        self.index, self.num_stages, self.ranks = stage_index, num_stages, ranks
        self.keys = [f"{name}/stage{k}" for k in range(num_stages)]
        self.box = _box(self.keys[stage_index])
        self._sends: list[torch.futures.Future] = []
        # schedule calls (steps and evals) completed; part of every mailbox key, so that a
        # stage that starts the next call early cannot deliver into the current one
        self.round = 0

    def new_context(self) -> int:
        return _contexts().new_context().context_id

    def recv_forward(self, micro: int) -> tuple[int, torch.Tensor]:
        return self.box.take(("F", self.round, micro), f"the activation of micro-batch {micro}")

    def send_forward(self, micro: int, context_id: int, out: torch.Tensor) -> None:
        nxt = self.index + 1
        with _contexts().bound(context_id):
            self._sends.append(rpc.rpc_async(self.ranks[nxt], deliver_activation,
                                             args=(self.keys[nxt], self.round, micro,
                                                   context_id, out)))

    def run_backward(self, micro: int, context_id: int, loss: torch.Tensor) -> dict:
        """Last stage: the whole distributed backward of one micro-batch; returns this stage's
        gradients after every earlier stage has taken its own, then frees the context."""
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        here = self.ranks[self.index]
        by_rank: dict[int, list[str]] = {}  # the earlier stages' boxes, per worker
        for k in range(self.index - 1, -1, -1):
            by_rank.setdefault(self.ranks[k], []).append(self.keys[k])
            if self.ranks[k] == here:  # another stage of this worker (interleaved)
                backward_done(self.keys[k], self.round, micro, context_id)
            else:
                rpc.rpc_sync(self.ranks[k], backward_done,
                             args=(self.keys[k], self.round, micro, context_id))
        for fut in _contexts().release(context_id):
            fut.wait()
        for rank, boxes in by_rank.items():
            if rank == here:
                for box in boxes:
                    _box(box).put(("B", self.round, micro), None)
            else:
                rpc.rpc_sync(rank, release_here, args=(boxes, self.round, micro, context_id))
        return grads

    def wait_backward(self, micro: int) -> dict:
        """An earlier stage: this stage's gradients of ``micro``, once its graph is freed."""
        grads = self.box.take(("G", self.round, micro), f"the gradients of micro-batch {micro}")
        self.box.take(("B", self.round, micro), f"the release of micro-batch {micro}")
        return grads

    def end_step(self) -> None:
        for fut in self._sends:
            fut.wait()
        self._sends.clear()
        self.round += 1
