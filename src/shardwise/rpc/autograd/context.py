"""One distributed autograd context on one worker: what was sent, received and accumulated."""

from __future__ import annotations

import threading

import torch

GradKey = tuple[int, int]  # (sending rank, sender's key)


class DistAutogradContext:
    """Bookkeeping of one backward graph's part on this worker.

    ``sends[key]``: tensors requiring grad that this worker sent in message ``key``; gradients
    for them come back in a BACKWARD message. ``recvs[key]``: the leaves this worker made from
    tensors requiring grad that it received; their gradients go back to the sender.
    ``grads``: accumulated gradients of this worker's real leaves (parameters), as torch keeps
    them in the context rather than in ``.grad``.
    """

    def __init__(self, context_id: int):
        self.context_id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, list[torch.Tensor]] = {}
        self.recvs: dict[GradKey, tuple[int, list[torch.Tensor]]] = {}
        self.recv_index: dict[int, tuple[GradKey, int]] = {}  # id(leaf) -> (key, position)
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.peers: set[int] = set()

    def record_send(self, key: int, tensors: list[torch.Tensor], peer: int) -> None:
        with self.lock:
            self.sends[key] = list(tensors)
            self.peers.add(peer)

    def record_recv(self, key: GradKey, tensors: list[torch.Tensor], peer: int) -> None:
        with self.lock:
            self.recvs[key] = (peer, list(tensors))
            for i, t in enumerate(tensors):
                self.recv_index[id(t)] = (key, i)
            self.peers.add(peer)

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            have = self.grads.get(leaf)
            self.grads[leaf] = grad.detach() if have is None else have + grad

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        with self.lock:
            return dict(self.grads)
