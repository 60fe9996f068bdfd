"""Our communication hooks, with the names and contract of torch's ``ddp_comm_hooks``.

Each is ``hook(state, bucket) -> Future[Tensor]`` (see shardwise/distributed/comm_hooks.py)
and runs on our DDP, on ZeRO stage 2 (``ZeroDataParallel.register_comm_hook``) and on
torch's DDP alike.

- ``allreduce_hook(group, bucket)``: the averaging all-reduce DDP does without a hook.
- ``fp16_compress_hook`` / ``bf16_compress_hook``: the bucket is cast to half precision,
  divided by the world size, all-reduced (half the bytes of fp32) and cast back into the buffer.
- ``powerSGD_hook(PowerSGDState, bucket)``: rank-``r`` approximation ``M ~ P Q^T`` of every
  gradient matrix worth compressing; two all-reduces per bucket (all P's, then all Q's) carry
  ``(n + m) r`` numbers instead of ``n m``; vectors and small matrices are all-reduced
  uncompressed, together with the P's. Error feedback adds what the approximation dropped to
  the next step's gradient; warm start reuses last step's Q. The first
  ``start_powerSGD_iter`` steps use the plain all-reduce.

[Note: PowerSGD's second all-reduce]
A bucket's Q all-reduce can only start once its P all-reduce has finished. torch's hook starts
it from the P all-reduce's completion callback, on a communication thread; with several buckets
in flight the ranks may then issue their collectives in different orders, which gloo reports as
a size mismatch (torch's own DDP and powerSGD_hook fail so on CPU with more than one bucket).
Ours issues every collective from the thread that calls the hook: when the hook runs for bucket
``k`` it first takes the earlier buckets' Q stage (waiting for their P all-reduce, usually done
by then, as backward computed in between), and the last bucket drains everything. The order
(P0, P1, Q0, P2, Q1, ...) is the same on every rank; what runs on completion callbacks is local
arithmetic only.
"""

import math
from typing import Any

import torch
import torch.distributed as dist

Future = torch.futures.Future
# the annotations torch's DDP checks on a hook it is given (so these are real objects, not the
# strings ``from __future__ import annotations`` would make them); ours take any bucket with
# GradBucket's methods
Bucket = dist.GradBucket
Result = torch.futures.Future[torch.Tensor]

__all__ = ["PowerSGDState", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook",
           "powerSGD_hook"]


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _average(tensor: torch.Tensor, group: dist.ProcessGroup) -> Future:
    """Divide by the group size, then start the summing all-reduce; the future's value is
    ``tensor`` itself once it holds the mean."""
    tensor.div_(group.size())
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: (f.wait(), tensor)[1])  # wait() re-raises a failure


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: Bucket) -> Result:
    """The mean of the bucket over ``process_group`` (default: the world) by one all-reduce."""
    return _average(bucket.buffer(), _group(process_group))


def _compress(dtype: torch.dtype, process_group: dist.ProcessGroup | None,
              bucket: Bucket) -> Result:
    group = _group(process_group)
    buffer = bucket.buffer()
    half = buffer.to(dtype)

    def land(done: Future) -> torch.Tensor:
        return buffer.copy_(done.wait())

    return _average(half, group).then(land)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: Bucket) -> Result:
    """The mean of the bucket, all-reduced in float16 (half the bytes)."""
    return _compress(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: Bucket) -> Result:
    """The mean of the bucket, all-reduced in bfloat16 (half the bytes, fp32's range)."""
    return _compress(torch.bfloat16, process_group, bucket)


class PowerSGDState:
    """What ``powerSGD_hook`` keeps between steps: the step count, each bucket's error
    (error feedback) and last Q's (warm start). Arguments keep torch's names; torch's
    ``orthogonalization_epsilon`` and ``batch_tensors_with_same_shape`` are not offered."""

    def __init__(self, process_group: dist.ProcessGroup | None,
                 matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True,
                 warm_start: bool = True, random_seed: int = 0):
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be at least 1, got "
                             f"{matrix_approximation_rank}")
        if use_error_feedback and start_powerSGD_iter < 1:
            raise ValueError("with error feedback, start_powerSGD_iter must be at least 1 (the "
                             "first step's all-reduce lets DDP settle its buckets)")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.iter = 0
        self.error_dict: dict[int, torch.Tensor] = {}
        self.pending: list[Any] = []  # buckets whose Q stage has not started (see the Note)
        self.q_memory_dict: dict[int, list[torch.Tensor]] = {}
        self._generator = torch.Generator().manual_seed(random_seed)

    def count(self, bucket: Any) -> None:
        """One step is over when its last bucket has been handled."""
        if bucket.is_last():
            self.iter += 1

    def random_q(self, m: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        """A fresh Q, the same on every rank (one seeded generator per state)."""
        q = torch.randn(m, rank, generator=self._generator)
        return q.to(device=like.device, dtype=like.dtype)


def _compressible(shape: torch.Size, state: PowerSGDState) -> tuple[int, int, int] | None:
    """``(n, m, r)`` when the gradient as an ``n x m`` matrix is worth a rank-r approximation."""
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    r = min(n, m, state.matrix_approximation_rank)
    return (n, m, r) if (n + m) * r * state.min_compression_rate < n * m else None


def powerSGD_hook(state: PowerSGDState, bucket: Bucket) -> Result:  # noqa: N802 (torch's name)
    """Low-rank compressed mean of the bucket (see the module docstring)."""
    group = _group(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.count(bucket)
        return _average(buffer, group)
    index = bucket.index()
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        original = buffer.clone()
    grads = bucket.gradients()
    shapes = [_compressible(g.shape, state) for g in grads]
    matrices = [g.view(s[0], s[1]) for g, s in zip(grads, shapes) if s is not None]
    plain = [g for g, s in zip(grads, shapes) if s is None]
    qs = _initial_qs(state, index, matrices, [s[2] for s in shapes if s is not None])
    ps = [m @ q for m, q in zip(matrices, qs)]
    first = torch.cat([t.reshape(-1) for t in plain + ps]) if plain or ps else buffer[:0]
    world = group.size()
    result: Future = Future()
    bases: list[torch.Tensor] = []

    def after_ps() -> None:
        _unpack(first[: sum(t.numel() for t in plain)], plain, world)
        _unpack(first[sum(t.numel() for t in plain):], ps, 1)
        for p, m, q in zip(ps, matrices, qs):
            bases.append(_orthonormal(p))
            torch.matmul(m.t(), bases[-1], out=q)
        flat_q = torch.cat([q.reshape(-1) for q in qs]) if qs else buffer[:0]
        fut = dist.all_reduce(flat_q, group=group, async_op=True).get_future()
        fut.then(lambda f: _settle(result, f, finish, flat_q))

    def finish(flat_q: torch.Tensor) -> torch.Tensor:
        _unpack(flat_q, qs, world)
        for basis, m, q in zip(bases, matrices, qs):
            torch.matmul(basis, q.t(), out=m)
        if state.use_error_feedback:
            state.error_dict[index] = original - buffer
        state.q_memory_dict[index] = qs if state.warm_start else []
        state.count(bucket)
        return buffer

    p_work = dist.all_reduce(first, group=group, async_op=True)
    _start_q_stages(state)  # earlier buckets' Q all-reduces, in bucket order
    state.pending.append(lambda: _settle(result, p_work.get_future(), after_ps))
    if bucket.is_last():
        _start_q_stages(state)
    return result


def _start_q_stages(state: PowerSGDState) -> None:
    """Run the pending buckets' second stage, oldest first, on this thread (see the Note)."""
    while state.pending:
        state.pending.pop(0)()


def _settle(result: Future, done: Future, step: Any, *args: Any) -> None:
    """Once the collective ``done`` has finished, run one stage of a chained hook (on the
    collective's thread); its failure, or the final value, goes to ``result``: a stage that
    raises must not leave the caller waiting."""
    try:
        done.wait()
        value = step(*args)
    except BaseException as exc:  # handed to whoever waits on the result
        result.set_exception(exc)
        return
    if value is not None:
        result.set_result(value)


def _initial_qs(state: PowerSGDState, index: int, matrices: list[torch.Tensor],
                ranks: list[int]) -> list[torch.Tensor]:
    kept = state.q_memory_dict.get(index) or []
    if state.warm_start and len(kept) == len(matrices):
        return kept
    return [state.random_q(m.shape[1], r, m) for m, r in zip(matrices, ranks)]


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of P's columns (reduced QR, in float32 for half precision)."""
    q, _ = torch.linalg.qr(p.float())
    return q.to(p.dtype)


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor], divisor: int) -> None:
    """Copy consecutive pieces of ``flat`` (divided by ``divisor``) back into ``tensors``."""
    offset = 0
    for t in tensors:
        piece = flat[offset : offset + t.numel()].view_as(t)
        t.copy_(piece / divisor if divisor != 1 else piece)
        offset += t.numel()
