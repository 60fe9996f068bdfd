"""ZeroRedundancyOptimizer's part in torch's ``Join`` context manager (uneven inputs).

``torch.distributed.algorithms.join.Join([model, optimizer])`` lets ranks run out of inputs at
different times. Every iteration a rank that still trains calls ``Join.notify_join_context``
(only the first joinable's call all-reduces a "still here" flag), then runs its step's
collectives. A rank that has run out instead loops in ``Join.__exit__``: one all-reduce to count
the ranks still training, then every joinable's ``main_hook``, which must issue the same
collectives as one iteration of theirs. For the optimizer that is ``step()``'s: this rank's
local step on the gradients its parameters hold at that moment (a hook earlier in the list may
set them) and the broadcasts of the updated parameters. The hook leaves out the
``notify_join_context`` call of ``step()``: a rank that has joined must not say it is training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.algorithms.join import JoinHook

if TYPE_CHECKING:
    from shardwise.zero.optimizer import ZeroRedundancyOptimizer


class ZeroJoinHook(JoinHook):
    """Shadows ``optimizer.step()`` on a rank that has run out of inputs."""

    def __init__(self, optimizer: ZeroRedundancyOptimizer):
        super().__init__()
        self.optimizer = optimizer

    def main_hook(self) -> None:
        """The collectives of one ``step()``: local step, then the parameter broadcasts."""
        self.optimizer._step_and_sync(None, {})
