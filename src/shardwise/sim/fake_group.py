"""A process group of N ranks in which this one process is rank ``rank``: torch's fake backend.

[Note: simulated ranks]
torch's ``"fake"`` backend (``torch.testing._internal.distributed.fake_pg``: a ``FakeStore`` for
rendezvous and a ``FakeProcessGroup`` whose collectives complete at once without moving data)
lets one process play one rank of a world of any size: every collective the library issues
returns immediately, its output left as it was, and the library's own code (wrapping,
sharding, bucketing, mesh groups, hooks) runs exactly as it would on that rank. Tensors are
made under ``FakeTensorMode`` (sim/step.py), so no parameter, gradient or optimizer state is
allocated: shapes, dtypes and storages exist, bytes do not. What a rank holds and sends is
therefore read from its tensors' metadata (the library's byte accounting) and from the
collectives' arguments (``CommCounter``), never from values. Values are meaningless by design.

This is the one module of the package that imports torch's private names: the fake process
group and ``FakeTensorMode`` / ``FakeTensor`` (torch._subclasses).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from shardwise._compat import FakeStore, FakeTensor, FakeTensorMode

__all__ = ["CountingFakeTensorMode", "FakeTensor", "SimulationError", "fake_tensors",
           "fake_world"]


class SimulationError(ValueError):
    """A dry run that cannot be set up as asked; the message names the problem."""


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Start the default process group as rank ``rank`` of ``world_size`` ranks on the fake
    backend, yield it, and destroy it on exit. No collective moves data (see
    [Note: simulated ranks]); none blocks."""
    if world_size < 1:
        raise SimulationError(f"the world size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise SimulationError(f"--rank {rank} is outside a world of {world_size} ranks "
                              f"(0 to {world_size - 1})")
    if dist.is_initialized():
        raise SimulationError("a process group is already initialized in this process; the "
                              "dry run needs a process of its own")
    # _compat imported torch's fake_pg module, which registers the "fake" backend
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore(),
                            timeout=timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class CountingFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` that counts the operators dispatched to it (``operators``): the work
    of a dry run, which does not depend on the world size when the code's is O(1) per rank."""

    operators = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def fake_tensors() -> CountingFakeTensorMode:
    """A mode in which every tensor made is fake (shape, dtype, storage; no bytes); real tensors
    made before it (the device mesh's rank table) may be read inside it."""
    return CountingFakeTensorMode(allow_non_fake_inputs=True)
