"""Counting the operators a block of code dispatches (to show work that must not grow)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounts(TorchDispatchMode):
    """``with OpCounts() as ops: ...`` then ``ops.counts["aten.any"]``: calls per operator
    (by overload packet name) on this thread inside the block."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
