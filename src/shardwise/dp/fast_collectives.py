"""All-gather and reduce-scatter on flat buffers, done the fastest equivalent way per backend.

[Note: fast collectives]
FSDP lives on two collectives over flat 1D buffers of equal shards: all-gather (every rank's
shard into one full buffer) and reduce-scatter (a full buffer from every rank, reduced, each
rank keeping its own part). On NCCL the plain c10d collectives are the best there is. On gloo
they are not: gloo's ``all_gather_into_tensor`` is slower than ``world_size`` broadcasts, one
from each rank into its slice of the output, and its ``reduce_scatter_tensor`` is a clone, a full
all-reduce and a copy, slower than an all-to-all (each rank receives every other rank's copy of
its own part, by point-to-point sends and receives) followed by a local sum. (ZeRO stage 2's
parts are whole parameters of unequal sizes; it has its own reduce-scatter,
zero/collectives.py.) The results are the
same: every rank sums the same values, and the local sum adds the ranks' contributions in rank
order (tests check both against the plain collectives, exactly for all-gather and to rounding for
reduce-scatter).

Both functions take ``async_op``. Asynchronous calls return a ``Pending`` whose ``wait()`` waits
for the underlying work and then does the local part (the sum and the averaging), so a caller can
issue a collective ahead of the compute that overlaps it and wait only when the data is needed.
gloo runs its collectives on its own threads, so even on CPU this overlaps communication with
compute; every rank must issue the same collectives in the same order, as for any collective.

``impl`` picks the method: ``"auto"`` (the fast one for the group's backend), ``"fast"`` or
``"plain"`` (the c10d collective), so that callers and benchmarks can compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from shardwise._compat import dist_all_gather, dist_reduce_scatter
from shardwise.distributed.groups import global_rank

Impl = Literal["auto", "fast", "plain"]


class Pending:
    """An issued collective: ``wait()`` blocks until its result is in place (idempotent)."""

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], None] | None = None):
        self._works = list(works)
        self._finish = finish
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            for work in self._works:
                work.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
        return True

    def wait_posted(self) -> None:
        """Wait for the collectives already issued and issue no other: ``wait`` here, whose
        finish only moves local data; a subclass whose finish issues a collective overrides
        it."""
        self.wait()

    def is_completed(self) -> bool:
        return self._done


def uses_fast_path(group: dist.ProcessGroup | None, tensor: torch.Tensor, impl: Impl) -> bool:
    """Whether ``impl`` on ``group`` means the broadcast / all-to-all method."""
    if impl not in ("auto", "fast", "plain"):
        raise ValueError(f"impl must be 'auto', 'fast' or 'plain', got {impl!r}")
    if impl != "auto":
        return impl == "fast"
    return dist.get_backend(group) == "gloo" and tensor.device.type == "cpu"


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor,
                    group: dist.ProcessGroup | None = None, async_op: bool = False,
                    impl: Impl = "auto") -> Pending | None:
    """Fill ``out`` (1D, ``world_size * shard.numel()``) with every rank's ``shard``, rank r's at
    ``out[r*n:(r+1)*n]``. Collective over ``group``: every rank calls it with equal sizes.

    Fast path: this rank copies its shard into place, then ``world_size`` broadcasts (rank r
    broadcasts its slice) fill the rest; all are issued at once and run on gloo's threads.
    """
    world, n = _check_flat(out, shard, group, "all_gather_flat")
    if world == 1:
        out.copy_(shard)
        return _result(Pending([]), async_op)
    if not uses_fast_path(group, out, impl):
        work = _ALL_GATHER(out, shard, group=group, async_op=True)
        return _result(Pending([work]), async_op)
    rank = dist.get_rank(group)
    out[rank * n : (rank + 1) * n].copy_(shard)
    works = [
        dist.broadcast(out[r * n : (r + 1) * n], src=global_rank(group, r), group=group,
                       async_op=True)
        for r in range(world)
    ]
    return _result(Pending(works), async_op)


def reduce_scatter_flat(shard_out: torch.Tensor, full: torch.Tensor,
                        group: dist.ProcessGroup | None = None, average: bool = True,
                        async_op: bool = False, impl: Impl = "auto",
                        workspace: torch.Tensor | None = None) -> Pending | None:
    """Set ``shard_out`` (1D, n) to the sum (or mean, ``average=True``) over ranks of their
    ``full[r*n:(r+1)*n]``, where r is this rank. Collective over ``group``.

    ``full`` is not modified, and must not be until the result is waited for; ``shard_out`` must
    not overlap it. Fast path: point-to-point sends and receives (an all-to-all that skips this
    rank's own part) bring the other ranks' copies of this rank's part: the lowest other rank's
    straight into ``shard_out``, the rest into a buffer of ``(world_size - 2) * n`` elements
    (``workspace`` if given, so that a caller reducing the same sizes every step does not pay for
    a fresh allocation; none at all on two ranks), then a local sum in rank order when the result
    is waited for.
    """
    world, n = _check_flat(full, shard_out, group, "reduce_scatter_flat")
    if world == 1:
        shard_out.copy_(full)
        return _result(Pending([]), async_op)
    if not uses_fast_path(group, full, impl):
        op = dist.ReduceOp.AVG if average and _has_avg(group) else dist.ReduceOp.SUM
        work = _REDUCE_SCATTER(shard_out, full, op=op, group=group, async_op=True)
        divide = average and op == dist.ReduceOp.SUM
        return _result(Pending([work], (lambda: shard_out.div_(world)) if divide else None),
                       async_op)
    _check_apart(shard_out, full)
    rank = dist.get_rank(group)
    # Only the other ranks' parts travel: this rank's own part stays where it is.
    pieces = _receive_buffers(shard_out, full, rank, world, workspace)
    ops = []
    for r in range(world):
        if r != rank:
            peer = global_rank(group, r)
            ops.append(dist.P2POp(dist.isend, full[r * n : (r + 1) * n], peer, group))
            ops.append(dist.P2POp(dist.irecv, pieces[r], peer, group))
    works = dist.batch_isend_irecv(ops)

    def finish() -> None:
        # shard_out holds rank 0's or rank 1's part (whichever is not this rank's): adding the
        # other of the two gives exactly pieces[0] + pieces[1] (addition is commutative), then
        # the rest in rank order, the same order on every rank; pairwise in-place adds are twice
        # as fast as torch.sum over a (world, n) view on CPU
        first = 1 if rank == 0 else 0
        shard_out.add_(pieces[1 - first])
        for piece in pieces[2:]:
            shard_out.add_(piece)
        if average:
            shard_out.div_(world)

    return _result(Pending(works, finish), async_op)


def _receive_buffers(shard_out: torch.Tensor, full: torch.Tensor, rank: int, world: int,
                     workspace: torch.Tensor | None) -> list[torch.Tensor]:
    """Every rank's copy of this rank's part, by rank: this rank's own is its slice of ``full``,
    the lowest other rank's is received into ``shard_out``, the rest into the workspace."""
    n = shard_out.numel()
    space = _workspace(workspace, (world - 2) * n, full)
    others = [r for r in range(world) if r != rank]
    pieces = {rank: full[rank * n : (rank + 1) * n], others[0]: shard_out}
    for k, r in enumerate(others[1:]):
        pieces[r] = space[k * n : (k + 1) * n]
    return [pieces[r] for r in range(world)]


def _check_apart(shard_out: torch.Tensor, full: torch.Tensor) -> None:
    a, b = shard_out.data_ptr(), full.data_ptr()
    if a < b + full.nbytes and b < a + shard_out.nbytes:
        raise ValueError("reduce_scatter_flat: shard_out must not overlap full (it receives "
                         "another rank's part while full is being sent)")


def _workspace(workspace: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    if workspace is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    if (workspace.numel() < numel or workspace.dtype != like.dtype
            or workspace.device != like.device or not workspace.is_contiguous()):
        raise ValueError(f"reduce_scatter_flat: workspace must be a contiguous {like.dtype} "
                         f"buffer of at least {numel} elements on {like.device}")
    return workspace.view(-1)[:numel]


def _check_flat(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None,
                what: str) -> tuple[int, int]:
    world = dist.get_world_size(group)
    if full.dim() != 1 or shard.dim() != 1:
        raise ValueError(f"{what}: buffers must be 1D, got shapes {tuple(full.shape)} and "
                         f"{tuple(shard.shape)}")
    if full.numel() != world * shard.numel():
        raise ValueError(f"{what}: the full buffer has {full.numel()} elements, expected "
                         f"world_size ({world}) x shard ({shard.numel()}) = "
                         f"{world * shard.numel()}")
    if full.dtype != shard.dtype or full.device != shard.device:
        raise ValueError(f"{what}: buffers differ in dtype/device: {full.dtype} on {full.device} "
                         f"vs {shard.dtype} on {shard.device}")
    if not (full.is_contiguous() and shard.is_contiguous()):
        raise ValueError(f"{what}: buffers must be contiguous")
    return world, shard.numel()


def _result(pending: Pending, async_op: bool) -> Pending | None:
    if async_op:
        return pending
    pending.wait()
    return None





_ALL_GATHER = dist_all_gather  # [Note: torch compatibility] in _compat.py
_REDUCE_SCATTER = dist_reduce_scatter


def _has_avg(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "nccl"
