"""Counting a dry run's collectives and its peak of gathered FSDP units.

``CommCounter`` skips operators whose arguments are tensor subclasses (they lower themselves
and come back as plain tensors), but in a dry run every tensor is a ``FakeTensor`` (see
[Note: simulated ranks] in fake_group.py), so ``SimCounter`` reads those too, with the same
readers and the same logical patterns ([Note: counting communication], comm_patterns.py).
It also samples, at every operator, the bytes of FSDP's gathered (unsharded) flat buffers, so
the peak of gathered units during forward and backward is the largest sum it saw.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.distributed.comm_counter import _READERS, CommCounter
from shardwise.sim.fake_group import is_plain_or_fake


class SimCounter(CommCounter):
    """A ``CommCounter`` for fake tensors; ``gathered()`` (bytes held unsharded right now) is
    sampled after every operator and its maximum kept in ``peak_gathered``."""

    def __init__(self, *, local_world_size: int | None = None,
                 gathered: Callable[[], int] | None = None):
        super().__init__(local_world_size=local_world_size)
        self._gathered = gathered
        self.peak_gathered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not all(is_plain_or_fake(t) for t in types):
            return NotImplemented  # DTensor lowers itself; its collectives come back here
        out = func(*args, **kwargs)
        reader = _READERS.get(getattr(func, "_schema", None) and func._schema.name)
        if reader is not None:
            kind, group, sizes = reader(*args, **kwargs)
            self._record(kind, group, sizes)
        if self._gathered is not None:
            self.peak_gathered = max(self.peak_gathered, self._gathered())
        return out

    def sent_by_kind(self) -> dict[str, int]:
        """Bytes this rank sent, per collective kind, summed over groups."""
        out: dict[str, int] = {}
        for (kind, _), stats in sorted(self.counts.items()):
            out[kind] = out.get(kind, 0) + stats.sent_bytes
        return out

    def calls(self) -> int:
        return sum(s.calls for s in self.counts.values())
