"""A buffer kept from one step to the next, handed out again only when nothing else holds it.

[Note: a reduced-gradient buffer kept across steps]
Each step, FSDP's reduce-scatter writes a unit's reduced shard into a buffer, and that buffer
becomes the sharded parameters' ``.grad`` (their local tensors are views of it). After
``zero_grad()`` sets them to None the buffer is freed, and the next step allocates one of the
same size. On the CPU its pages then come back from the OS zero-filled: the kernel clears
1/world of the model's gradient bytes every step and takes a fault per page, mostly inside the
gloo receive that copies a peer's rows into it (the heap's free pages had been handed back by
[Note: allocator slack], memory/heap.py).

So each unit keeps its last buffer. ``take`` hands it out again when its storage is used by no
tensor but the keeper's, that is when every gradient made from it was dropped; else it
allocates a new one and keeps that instead. A gradient somebody still holds
(``zero_grad(set_to_none=False)``, accumulation over several backwards, a reference kept by
the user) is never written over. Between steps the buffer stays resident: 1/world of the
unit's gradient. The backward peak held those sharded gradients anyway; the forward peak, lower
before, now holds them too and comes up to about the backward one (docs/fsdp.md).

CPU only: on CUDA the caching allocator already reuses freed blocks without clearing them, and
only it knows whether a stream still reads one. Where torch has no storage use count
(``_storage_Use_Count``, _compat.py) every ``take`` allocates.
"""

from __future__ import annotations

import sys

import torch

from shardwise._compat import storage_use_count, storage_uses


class KeptBuffer:
    """One 1D buffer, reused by ``take`` while no one else holds it (see the Note)."""

    def __init__(self) -> None:
        self._kept: torch.Tensor | None = None
        self._alone: tuple[int | None, int, int] = (0, 0, 0)  # _holders() when kept alone

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D tensor of ``numel`` elements whose values are unspecified: the kept one if it
        fits and nothing else uses it, else a new one (kept from now on, on the CPU)."""
        kept = self._kept is not None and self._fits(numel, dtype, device)
        if kept and self._holders() == self._alone:  # nothing but self._kept holds it
            return self._kept
        self._kept = torch.empty(numel, dtype=dtype, device=device)
        if self._kept.device.type != "cpu" or not storage_use_count:
            fresh, self._kept = self._kept, None
            return fresh
        # measured while only self._kept refers to it, as the check above measures it
        self._alone = self._holders()
        return self._kept

    def _fits(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        kept = self._kept
        return (kept.numel() == numel and kept.dtype == dtype
                and kept.device == torch.device(device))

    def _holders(self) -> tuple[int | None, int, int]:
        """Who holds the kept buffer: its storage's C++ users (views and storage slices each
        count), and Python's references to the tensor and to its storage object (the same
        tensor or storage handed on counts there only)."""
        kept = self._kept
        storage = kept.untyped_storage()
        return storage_uses(kept), sys.getrefcount(kept), sys.getrefcount(storage)
