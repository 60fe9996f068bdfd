"""The point-to-point transport: each stage is one rank of the pipeline group; activations go
forward and their gradients backward with c10d ``isend`` / ``irecv``.

[Note: p2p pipeline messages] Between stage k and k+1 flow, per step: one shape header (a small
int64 tensor: dtype code, ndim, sizes) before the first micro-batch's activation, then one
activation per micro-batch, all k -> k+1 in micro-batch order; and one gradient per micro-batch
k+1 -> k, in the order the schedule runs backwards (micro-batch order for GPipe and 1F1B).
Every micro-batch of a step has the same shape (the schedule splits the batch evenly), so the
header is sent once per step; a gradient has the shape of the activation it belongs to, which
the sender of that activation already knows, so gradients need no header. Sends are
asynchronous (the schedule waits for them at the end of the step, keeping each sent tensor alive
until then). Receives are posted early (the next activation's as soon as the current one
arrived, a gradient's as soon as its activation is sent), so that data lands while the stage
computes, and waited for when needed. The order of messages on each (sender, receiver) pair is
the order both sides run their schedules in, and receives match in the order they were posted.
A rank that holds several stages (interleaved schedules: stage k on rank k % size) talks to the
same peer over several boundaries, so each boundary's two directions have their own tags; within
one tag the order argument above holds. A step that fails midway leaves the pipeline unusable
(peers wait in their receives until the group's timeout).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
MAX_DIMS = 8


def encode_meta(t: torch.Tensor) -> torch.Tensor:
    """The header that announces ``t``: ``[dtype code, ndim, size_0, ..., 0 padding]``."""
    if t.dtype not in _DTYPES:
        raise TypeError(f"a pipeline activation of dtype {t.dtype} cannot be sent; "
                        f"supported: {_DTYPES}")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"a pipeline activation has at most {MAX_DIMS} dims, got {t.dim()}")
    meta = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
    meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
    meta[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


def decode_meta(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim = int(meta[1])
    return torch.Size(meta[2 : 2 + ndim].tolist()), _DTYPES[int(meta[0])]


class P2PRuntime:
    """Sends and receives of one stage; see [Note: p2p pipeline messages]."""

    def __init__(self, group: dist.ProcessGroup, stage_index: int, num_stages: int,
                 device: torch.device):
        self.group, self.device = group, device
        size = dist.get_world_size(group)
        first, last = stage_index == 0, stage_index == num_stages - 1
        self.prev = None if first else dist.get_global_rank(group, (stage_index - 1) % size)
        self.next = None if last else dist.get_global_rank(group, (stage_index + 1) % size)
        # the messages over boundary b (stage b to b + 1) carry tags 2b (forward) and 2b + 1
        # (backward): a rank's stages exchange with the same peer over separate channels
        self._tag_in = (2 * (stage_index - 1), 2 * (stage_index - 1) + 1)
        self._tag_out = (2 * stage_index, 2 * stage_index + 1)
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._in_meta: tuple[torch.Size, torch.dtype] | None = None
        self._sent_meta = False
        self._n = self._received = 0
        self._fwd_recvs: deque[tuple[dist.Work, torch.Tensor]] = deque()
        self._bwd_recvs: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def begin_step(self, n_microbatches: int) -> None:
        self._in_meta, self._sent_meta = None, False
        self._n, self._received = n_microbatches, 0

    def recv_forward(self) -> torch.Tensor:
        """This micro-batch's input; the next one's receive is posted at once, so that it
        lands while this one computes."""
        if self._in_meta is None:
            meta = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
            dist.recv(meta, src=self.prev, group=self.group, tag=self._tag_in[0])
            self._in_meta = decode_meta(meta.cpu())
        if not self._fwd_recvs:
            self._post_fwd_recv()
        work, x = self._fwd_recvs.popleft()
        work.wait()
        self._received += 1
        if self._received < self._n:
            self._post_fwd_recv()
        return x

    def send_forward(self, out: torch.Tensor, expect_grad: bool = True) -> None:
        """Send an activation, and post the receive of its gradient (same shape) right away
        (unless the step runs forwards only); gradients come back in the order activations
        went out."""
        if not self._sent_meta:
            self._isend(encode_meta(out).to(self.device), self.next, self._tag_out[0])
            self._sent_meta = True
        self._isend(out.detach().contiguous(), self.next, self._tag_out[0])
        if not expect_grad:
            return
        grad = torch.empty(out.shape, dtype=out.dtype, device=self.device)
        work = dist.irecv(grad, src=self.next, group=self.group, tag=self._tag_out[1])
        self._bwd_recvs.append((work, grad))

    def recv_backward(self, like: torch.Tensor) -> torch.Tensor:
        work, grad = self._bwd_recvs.popleft()
        if grad.shape != like.shape:
            raise RuntimeError(f"gradient of shape {tuple(grad.shape)} for an activation of "
                               f"shape {tuple(like.shape)}: the schedules are out of step")
        work.wait()
        return grad

    def _post_fwd_recv(self) -> None:
        shape, dtype = self._in_meta
        x = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(x, src=self.prev, group=self.group, tag=self._tag_in[0])
        self._fwd_recvs.append((work, x))

    def send_backward(self, grad: torch.Tensor) -> None:
        self._isend(grad.contiguous(), self.prev, self._tag_in[1])

    def end_step(self) -> None:
        """Wait for every send of the step (the peers have received them all by now or soon)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._sends.append((dist.isend(t, dst=dst, group=self.group, tag=tag), t))
