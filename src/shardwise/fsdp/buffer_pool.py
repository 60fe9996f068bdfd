"""Unsharded parameter memory handed from unit to unit instead of freed and allocated again.

[Note: unshard buffer pool]
A unit's ``full_data`` keeps one storage for its life ([Note: flat parameters]): autograd's saved
tensors point at it. Unsharding gives that storage memory, resharding takes it away. With
``resize_`` on the CPU that is one ``malloc`` and one ``free`` of the whole unit per gather: a
unit's buffer (tens of MB) is above glibc's largest mmap threshold, so every gather maps fresh
pages and faults each of them in (a zero-filled page per 4 KiB: about as much CPU as copying
the buffer three to four times), and every reshard unmaps them. On the FSDP benchmark GPT that
was a third of a GB of fresh pages per rank and step, in forward and again in backward.

The pool instead keeps the memory a unit gives back at reshard (``give``: its storage's data
pointer is swapped into an empty holder storage) and hands it to the next unit of the same size
that unshards (``take``: swapped back into that unit's empty storage), so the pages stay
resident and are written without faults. No value changes: every gather overwrites all of the
buffer. The pool never holds more buffers of a size than were unsharded at once (a buffer joins
it only when a unit reshards, and leaves when a unit unshards), so it adds nothing to the peak
of gathered memory; and it holds a buffer only from a unit's reshard to the gathers that follow
at once (the next unit's pre-forward in forward, the prefetch issued by the same post-backward
in backward). What no gather took then is freed: the pool is emptied after each pre-forward's
gathers and each post-backward's prefetch, at the end of the root's forward and at the end of
backward (unit.py, root.py), so no pooled buffer is held while a unit computes, nor through the
optimizer step or between steps. Per step, the first gathers of forward (the root and the units
gathered with it) and the first prefetch of backward allocate; every other gather reuses.
One pool per root unit, so the trees of different models share nothing.

Only for CPU storages, and only where torch has ``UntypedStorage._swap_data_ptr_``; elsewhere
(and on CUDA, whose caching allocator already reuses blocks) ``resize_`` does the work.
"""

from __future__ import annotations

import torch


def _swappable(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cpu" and hasattr(storage, "_swap_data_ptr_")


class StoragePool:
    """Free unit buffers by (bytes, device); see [Note: unshard buffer pool]."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list[torch.UntypedStorage]] = {}

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a pooled buffer of ``nbytes``; False if none is free (the
        caller allocates)."""
        if storage.nbytes() or not _swappable(storage):
            return False
        free = self._free.get((nbytes, str(storage.device)))
        if not free:
            return False
        storage._swap_data_ptr_(free.pop())
        return True

    def give(self, storage: torch.UntypedStorage) -> bool:
        """Move ``storage``'s memory into the pool, leaving it empty; False if it cannot be
        pooled (the caller frees it)."""
        if not storage.nbytes() or not _swappable(storage):
            return False
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._free.setdefault((holder.nbytes(), str(holder.device)), []).append(holder)
        return True

    def pooled_bytes(self) -> int:
        """Bytes of free buffers the pool holds right now."""
        return sum(s.nbytes() for free in self._free.values() for s in free)

    def clear(self) -> None:
        """Let every pooled buffer go (freed when nothing else holds it)."""
        self._free.clear()
