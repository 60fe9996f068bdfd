"""What both kinds of direct exchange share ([Note: direct gradient reduction]): where each
peer's copy of this rank's rows goes, and the bookkeeping of phases run on the unit's threads.

An exchange over gloo (``_Exchange``, grad_exchange.py) has one phase, run on the unit's
exchange thread; one that reads the peers' memory (``PulledExchange``, peer_exchange.py) has
two, each on its own thread. It is done once every phase has run; the first error any phase
met is raised to the compute thread by ``finish``.
"""

from __future__ import annotations

import threading

import torch


def receive_buffers(own: torch.Tensor, dest: torch.Tensor, into_dest: bool, rank: int,
                    world: int) -> tuple[list[tuple[int, torch.Tensor]], list[torch.Tensor]]:
    """``(reads, pieces)`` for this rank's rows ``own`` of one parameter: ``reads`` pairs each
    other rank with where its copy goes (the lowest one's straight into ``dest`` when
    ``into_dest``, the others into new workspaces); ``pieces`` are what is then added into
    ``dest``: ``own`` and the workspaces, in that order."""
    reads, pieces = [], [own]
    for k, r in enumerate(r for r in range(world) if r != rank):
        buf = dest if k == 0 and into_dest else torch.empty_like(own)
        if buf is not dest:
            pieces.append(buf)
        reads.append((r, buf))
    return reads, pieces


class PhasedExchange:
    """An exchange whose phases, the methods named in ``PHASES``, run on the unit's threads,
    one thread per phase (see the module's doc)."""

    PHASES: tuple[str, ...] = ("run",)

    def __init__(self) -> None:
        self.arrived = threading.Event()  # set once every phase has run (or failed)
        self.error: BaseException | None = None
        self.deferred = False  # waited for in vain: left to the unit's reduction
        self._lock, self._phases_left = threading.Lock(), len(self.PHASES)

    def held(self) -> list[torch.Tensor]:
        """The tensors the exchange still holds (its gradient, workspaces)."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.held()}
        return sum(storages.values())

    def done(self) -> bool:
        return self.arrived.is_set()

    def phase_done(self, error: BaseException | None) -> None:
        """A thread ran one phase (``error``: what it raised, if anything)."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._phases_left -= 1
            last = self._phases_left == 0
        if last:
            self.arrived.set()

    def finish(self) -> None:
        """Wait until every phase has run; raise the first error one met."""
        self.arrived.wait()
        if self.error is not None:
            raise self.error
