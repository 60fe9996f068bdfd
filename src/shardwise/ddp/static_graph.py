"""DDP's static graph: a parameter is ready after as many hook firings as in the first pass.

``static_graph=True`` (or ``_set_static_graph()``) declares that every backward uses the same
parameters the same number of times. The first reduction counts, for each parameter, how many
times its hook fires (reentrant checkpointing fires it once per use) and copies every gradient
when backward ends; from then on a parameter is ready, and its bucket may launch, after that many
firings. Without it, a second firing before the bucket's launch re-copies the accumulated
gradient, and one after it is an error (its new part could not be reduced). A static graph also
allows unused parameters (found once, by the unused-parameter map, unused.py).
"""

from __future__ import annotations

from torch import nn

from shardwise.dp.buckets import Bucket
from shardwise.dp.grad_buckets import BucketPolicy


class StaticGraph(BucketPolicy):
    """Firing counts learned in the first reduction (see the module docstring)."""

    allows_missing = True

    def __init__(self) -> None:
        self._fired: dict[nn.Parameter, int] = {}  # firings in this reduction
        self._expected: dict[nn.Parameter, int] | None = None  # learned in the first one

    def admit(self, param: nn.Parameter, bucket: Bucket, i: int) -> bool:
        """Count a firing; ready when it is the last one of the learned count."""
        fired = self._fired[param] = self._fired.get(param, 0) + 1
        if self._expected is None:
            return False  # first reduction: everything is copied when backward ends
        expected = self._expected.get(param, 0)
        if fired > expected:
            raise RuntimeError(
                f"static graph: parameter {bucket.names[i]} received {fired} gradients in this "
                f"backward pass, {expected} in the first one; the graph is not static"
            )
        return fired == expected

    def end_of_backward(self) -> None:
        """The first static reduction: copy every gradient that arrived, learn the counts."""
        if self._expected is not None:
            return
        for param in self._fired:
            self.bucketer.fill(param, param.grad, release=True)
        self._expected = dict(self._fired)

    def end_reduction(self) -> None:
        self._fired.clear()
