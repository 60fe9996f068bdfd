"""Counting the activation bytes a stage keeps for backward.

[Note: activation accounting] A process peak (RSS) mixes parameters, optimizer state and the
allocator's cached blocks; what a pipeline schedule changes is how many micro-batches' saved
activations are alive at once. ``ActivationMeter`` installs
``torch.autograd.graph.saved_tensors_hooks`` around a stage's forward: every tensor autograd saves
is counted by its storage (a storage saved twice, or by two ops, counts once) until the graph
that holds it lets go of it (after backward, or when the graph is dropped). Storages of the
stage's own parameters are not activations and are skipped. No collective: each stage measures
its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch


class _Saved:
    """What the pack hook returns: the tensor; uncounts its storage when the graph drops it."""

    __slots__ = ("tensor", "_release", "_ptr", "_nbytes")

    def __init__(self, tensor: torch.Tensor, release: Callable[[int, int], None], ptr: int,
                 nbytes: int):
        self.tensor, self._release, self._ptr, self._nbytes = tensor, release, ptr, nbytes

    def __del__(self) -> None:
        self._release(self._ptr, self._nbytes)


class ActivationMeter:
    """Live and peak bytes of saved activations; use ``with meter.recording():`` around
    forwards. ``reset_peak()`` starts a new peak from the bytes alive now."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}  # storage pointer -> saved tensors alive that use it
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0

    def recording(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude or storage.nbytes() == 0:
            return tensor
        with self._lock:
            count = self._refs.get(ptr, 0)
            self._refs[ptr] = count + 1
            if count == 0:
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        # Detached: a saved output that kept its own grad_fn would form a cycle through the
        # graph that Python's collector cannot see (when backward retains the graph, as the RPC
        # engine's does, it would never be freed). Same storage and version counter.
        return _Saved(tensor.detach(), self._release, ptr, storage.nbytes())

    def _release(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            count = self._refs.pop(ptr) - 1
            if count:
                self._refs[ptr] = count
            else:
                self.live_bytes -= nbytes


def _unpack(packed: object) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed
