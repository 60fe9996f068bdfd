"""The distributed backward pass: local autograd passes chained by BACKWARD messages.

[Note: distributed backward] Every tensor requiring grad that crosses an RPC is recorded on both
sides (context.py): the sender keeps the original (with its local graph), the receiver turns it
into a leaf. A backward pass on one worker runs ``torch.autograd.grad`` from its roots to every
leaf reachable from them: gradients of real leaves (parameters) accumulate in the context, and
gradients of leaves that came from another worker are sent back to that worker in one BACKWARD
message per received message, where the same happens from the sent tensors. Backward is linear,
so running separate passes for gradients that reach a worker at different times and summing
their results equals one pass over the summed gradients; the graph is retained because such
passes may share nodes, and is freed when the context is released. A BACKWARD request is
answered once the local pass and every pass it caused downstream have finished, so the root's
``backward()`` returns when the whole distributed graph is done; waiting is done by chaining
futures, never by blocking a pool thread. A pass's real-leaf gradients go through
``reduce_detached_gradients`` before they are stored, so that data-parallel wrappers (DDP)
average theirs across replicas, as torch's DDP does under distributed autograd (see
[Note: reduction outside autograd's accumulation] in shardwise/ddp/detached.py);
that reduction waits on its collectives on the thread that runs the pass (the only wait here),
after the pass's BACKWARD messages are sent.
"""

from __future__ import annotations

import torch

from shardwise.dp.leaf_grads import reduce_detached_gradients
from shardwise.rpc.autograd.context import DistAutogradContext
from shardwise.rpc.messages import Kind


def collect_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf tensor requiring grad reachable from ``roots`` through their graphs."""
    leaves: dict[int, torch.Tensor] = {}
    # holds each node visited: a node's Python object can be made afresh on each access
    # (torch 2.12 does), and a freed one's id reused by the next, which would read as seen
    seen: dict[int, object] = {}
    stack = []
    for r in roots:
        if r.grad_fn is None:
            if r.requires_grad:
                leaves[id(r)] = r
        else:
            stack.append(r.grad_fn)
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        var = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None:
            leaves[id(var)] = var
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return list(leaves.values())


def local_pass(agent, ctx: DistAutogradContext, roots: list[torch.Tensor],
               grads: list[torch.Tensor | None]) -> list[torch.futures.Future]:
    """One local backward from ``roots``; returns the futures of the BACKWARD messages sent."""
    pairs = [(r, g) for r, g in zip(roots, grads) if g is not None and r.requires_grad]
    if not pairs:
        return []
    outs, grad_outs = [p[0] for p in pairs], [p[1] for p in pairs]
    leaves = collect_leaves(outs)
    if not leaves:
        return []
    got = torch.autograd.grad(outs, leaves, grad_outs, retain_graph=True, allow_unused=True)
    outgoing: dict = {}
    own: dict[torch.Tensor, torch.Tensor] = {}
    for leaf, g in zip(leaves, got):
        if g is None:
            continue
        where = ctx.recv_index.get(id(leaf))
        if where is None:
            own[leaf] = g
            continue
        key, pos = where
        peer, tensors = ctx.recvs[key]
        slots = outgoing.setdefault(key, [None] * len(tensors))
        slots[pos] = g if slots[pos] is None else slots[pos] + g
    sent = [agent.request(key[0], Kind.BACKWARD, (ctx.context_id, key[1], slots),
                          agent.options.rpc_timeout, "distributed backward", ctx_id=None)
            for key, slots in outgoing.items()]
    # after sending, so that peers go on while data-parallel gradients are reduced here
    for leaf, g in reduce_detached_gradients(own).items():
        ctx.accumulate(leaf, g)
    return sent


def propagate(agent, ctx: DistAutogradContext, roots: list[torch.Tensor],
              grads: list[torch.Tensor | None]) -> torch.futures.Future:
    """A local pass, then a future that completes when every pass it caused has completed."""
    futs = local_pass(agent, ctx, roots, grads)
    done = torch.futures.Future()
    if not futs:
        done.set_result(None)
        return done

    def finish(all_done: torch.futures.Future) -> None:
        try:
            for f in all_done.value():
                f.value()  # raises the first downstream error
        except BaseException as exc:  # noqa: BLE001
            done.set_exception(exc)
            return
        done.set_result(None)

    torch.futures.collect_all(futs).add_done_callback(finish)
    return done


def backward(agent, ctx: DistAutogradContext, roots: list[torch.Tensor]) -> None:
    """Start at scalar ``roots`` with gradient 1 and wait until the whole graph is done."""
    for r in roots:
        if r.numel() != 1:
            raise RuntimeError(f"distributed backward roots must be scalars, got shape "
                               f"{tuple(r.shape)}")
        if not r.requires_grad:
            raise RuntimeError("a backward root does not require grad")
    propagate(agent, ctx, roots, [torch.ones_like(r) for r in roots]).wait()
