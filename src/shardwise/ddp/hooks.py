"""Our communication hooks, with the names and contract of torch's ``ddp_comm_hooks``.

Each is ``hook(state, bucket) -> Future[Tensor]`` (see shardwise/dp/comm_hooks.py)
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

    def count(self, is_last: bool) -> None:
        """One step is over when its last bucket has been handled."""
        if is_last:
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
    """Low-rank compressed mean of the bucket (see the module docstring): last step's error is
    added to the bucket, :func:`compress_bucket` runs the round in place."""
    group = _group(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.count(bucket.is_last())
        return _average(buffer, group)
    grads = bucket.gradients()
    errors = None
    if state.use_error_feedback:
        error = state.error_dict.get(bucket.index())
        if error is not None and error.shape == buffer.shape:
            buffer.add_(error)
        else:  # the first compressed step (or buckets that changed): no error yet
            error = state.error_dict[bucket.index()] = torch.zeros_like(buffer)
        errors = [error[o : o + g.numel()].view_as(g)
                  for o, g in zip(_offsets(grads, buffer), grads)]
    return compress_bucket(state, group, bucket.index(), bucket.is_last(), grads, grads,
                           errors, buffer)


def compress_bucket(state: PowerSGDState, group: dist.ProcessGroup, index: int, is_last: bool,
                    grads: list[torch.Tensor], outs: list[torch.Tensor],
                    errors: list[torch.Tensor] | None, value: Any) -> Result:
    """One bucket's PowerSGD round. ``grads`` hold this rank's gradients with last step's error
    already added (M); the mean over ``group`` lands in ``outs`` (``grads`` themselves, or
    other tensors of the same shapes) and, with error feedback, what this rank's M loses to it
    in ``errors`` (in place: the error of the next step). Two all-reduces over ``group``: the
    uncompressed tensors with every P, then every Q, issued from this thread in bucket order
    (see [Note: PowerSGD's second all-reduce]). The future's value is ``value``."""
    round_ = _Round(state, group, index, is_last, grads, outs, errors, value)
    p_work = dist.all_reduce(round_.first, group=group, async_op=True)
    _start_q_stages(state)  # earlier buckets' Q all-reduces, in bucket order
    state.pending.append(lambda: _settle(round_.result, p_work.get_future(), round_.second))
    if is_last:
        _start_q_stages(state)
    return round_.result


class _Round:
    """The tensors of one bucket's round and its two local stages (see compress_bucket)."""

    def __init__(self, state: PowerSGDState, group: dist.ProcessGroup, index: int,
                 is_last: bool, grads: list[torch.Tensor], outs: list[torch.Tensor],
                 errors: list[torch.Tensor] | None, value: Any):
        self.state, self.group, self.index, self.is_last = state, group, index, is_last
        layout = [_compressible(g.shape, state) for g in grads]
        errors = errors if errors is not None else [None] * len(grads)
        # (M, where the mean goes, where the error goes), as matrices or as they are
        self.matrices = list(zip(*(_pick(t, layout, True) for t in (grads, outs, errors))))
        self.plain = list(zip(*(_pick(t, layout, False) for t in (grads, outs, errors))))
        ms = [m for m, _, _ in self.matrices]
        self.qs = _initial_qs(state, index, ms, [s[2] for s in layout if s is not None])
        self.first = torch.cat([t.reshape(-1) for t, _, _ in self.plain]
                               + [(m @ q).reshape(-1) for m, q in zip(ms, self.qs)])
        self.bases: list[torch.Tensor] = []
        self.result: Future = Future()
        self.value = value

    def second(self) -> None:
        """Once the first all-reduce is done: the means of the uncompressed tensors, an
        orthonormal basis of each summed P, Q = M^T basis, and the Q all-reduce."""
        world = self.group.size()
        shapes = [t.shape for t, _, _ in self.plain]
        shapes += [(m.shape[0], q.shape[1]) for (m, _, _), q in zip(self.matrices, self.qs)]
        pieces = _pieces(self.first, shapes)
        for (t, out, err), piece in zip(self.plain, pieces):
            mean = piece / world
            if err is not None:
                torch.sub(t, mean, out=err)
            out.copy_(mean)
        for (m, _, _), p, q in zip(self.matrices, pieces[len(self.plain):], self.qs):
            self.bases.append(_orthonormal(p))
            torch.matmul(m.t(), self.bases[-1], out=q)
        flat_q = torch.cat([q.reshape(-1) for q in self.qs]) if self.qs else self.first[:0]
        fut = dist.all_reduce(flat_q, group=self.group, async_op=True).get_future()
        fut.then(lambda f: _settle(self.result, f, self.finish, flat_q))

    def finish(self, flat_q: torch.Tensor) -> Any:
        """Once the Q all-reduce is done (on its thread): the mean ``basis @ Q.T`` of each
        matrix, and what it drops from this rank's M."""
        for q, piece in zip(self.qs, _pieces(flat_q, [q.shape for q in self.qs])):
            torch.div(piece, self.group.size(), out=q)
        for (m, out, err), basis, q in zip(self.matrices, self.bases, self.qs):
            if err is not None:
                _residual(m, basis, q, out=err)
            torch.matmul(basis, q.t(), out=out)
        self.state.q_memory_dict[self.index] = self.qs if self.state.warm_start else []
        self.state.count(self.is_last)
        return self.value


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


def _residual(m: torch.Tensor, basis: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """``out = m - basis @ q.T`` in one pass over ``m`` (an outer product for rank 1)."""
    if basis.shape[1] == 1:
        torch.addcmul(m, basis, q.t(), value=-1, out=out)
    else:
        torch.addmm(m, basis, q.t(), alpha=-1, out=out)


def _pick(tensors: list[Any], layout: list[tuple[int, int, int] | None],
          matrices: bool) -> list[Any]:
    """The compressed ones among ``tensors`` as ``n x m`` matrices, or the others as they are
    (``layout`` says which is which, position by position)."""
    if matrices:
        return [t if t is None else t.view(s[0], s[1])
                for t, s in zip(tensors, layout) if s is not None]
    return [t for t, s in zip(tensors, layout) if s is None]


def _pieces(flat: torch.Tensor, shapes: list[Any]) -> list[torch.Tensor]:
    """Consecutive pieces of ``flat``, one of each shape."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def _offsets(grads: list[torch.Tensor], buffer: torch.Tensor) -> list[int]:
    """Where each gradient view starts in the bucket's flat buffer."""
    return [g.storage_offset() - buffer.storage_offset() for g in grads]
