"""Counting a dry run's collectives and its peak of gathered FSDP units.

In a dry run every tensor is a ``FakeTensor`` (see [Note: simulated ranks] in fake_group.py);
``CommCounter`` reads collectives on fake tensors as on plain ones, with the same readers and
the same logical patterns ([Note: counting communication], comm_patterns.py). ``SimCounter``
adds one thing: it samples, at every operator, the bytes of FSDP's gathered (unsharded) flat
buffers, so the peak of gathered units during forward and backward is the largest sum it saw.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.distributed.comm_counter import CommCounter


class SimCounter(CommCounter):
    """A ``CommCounter`` for fake tensors; ``gathered()`` (bytes held unsharded right now) is
    sampled after every operator and its maximum kept in ``peak_gathered``."""

    def __init__(self, *, local_world_size: int | None = None,
                 gathered: Callable[[], int] | None = None):
        super().__init__(local_world_size=local_world_size)
        self._gathered = gathered
        self.peak_gathered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self._gathered is not None:
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
