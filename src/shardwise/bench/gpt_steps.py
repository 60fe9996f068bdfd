"""The timed training loop that the GPT benchmarks share (DDP, ZeRO, FSDP).

Every rank trains the wrapped demo GPT on its slice of a global batch from the stdlib corpus and
times each step (forward, backward, optimizer step, zero_grad) after ``args.warmup`` steps. A
barrier before each step makes the ranks start together, so a step's time is the step's own and
not the skew between ranks. With ``--device cuda`` the batch is copied to the rank's device
before the clock starts and the device is synchronized before it stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.bench.limits import synchronize
from shardwise.bench.sidebyside import bench_device
from shardwise.data import BatchStream, TokenWindows, load_corpus
from shardwise.models import lm_loss


def batch_stream(seq_len: int, global_batch: int, group: dist.ProcessGroup) -> BatchStream:
    """This rank's slice of each global batch of the corpus."""
    windows = TokenWindows(load_corpus(2_000_000).train, seq_len)
    return BatchStream(windows, global_batch, dist.get_rank(group), dist.get_world_size(group))


class _ExposedComm:
    """Per timed step, the seconds our bucketer spent at the end of backward waiting for and
    finishing its reductions (``GradBucketer.last_finalize_s``): the communication that did not
    overlap backward's compute. Nothing for wrappers without our bucketer (torch's)."""

    def __init__(self, wrapped: torch.nn.Module, warmup: int):
        self.reducer = getattr(wrapped, "reducer", None)
        self.warmup, self.seconds = warmup, []

    def record(self, step: int) -> None:
        if step >= self.warmup and hasattr(self.reducer, "last_finalize_s"):
            self.seconds.append(self.reducer.last_finalize_s)

    def summary(self) -> dict:
        if not self.seconds:
            return {}
        return {"exposed_comm_ms": round(1000 * sorted(self.seconds)[len(self.seconds) // 2], 1)}


def exposed_comm_probe(wrapped: torch.nn.Module, warmup: int) -> _ExposedComm:
    return _ExposedComm(wrapped, warmup)


def timed_steps(wrapped: torch.nn.Module, opt: torch.optim.Optimizer, stream: BatchStream,
                args, group: dist.ProcessGroup,
                after_step: Callable[[int], None] | None = None) -> list[float]:
    """Seconds per timed step; ``after_step(step)`` runs after ``opt.step()``, before
    ``zero_grad``, inside the timing (keep it cheap, or call it on a warm-up step only)."""
    times = []
    device = bench_device(args)
    for step in range(args.warmup + args.steps):
        x, y = (t.to(device) for t in stream.batch(step))
        synchronize(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        lm_loss(wrapped(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step(step)
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times
