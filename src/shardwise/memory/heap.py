"""Handing the C heap's free pages back to the OS (glibc's ``malloc_trim``).

[Note: allocator slack]
Tensors on the CPU come from ``malloc``. glibc serves a large request with its own ``mmap``,
returned to the OS when freed, but after the first such block is freed it raises its mmap
threshold to that block's size (up to 32 MiB on 64-bit), so later blocks of up to that size
(a transformer block's weight gradients, a unit's reduced shard, an optimizer's temporaries)
come from the heap. Freed heap blocks keep their pages: they stay in the process's resident set
until a later request of a fitting size reuses them. So peak RSS is the live peak plus
whatever free, resident heap is not reused at that moment: on the FSDP benchmark GPT about
70 MiB per rank at the backward peak (docs/fsdp.md).

``malloc_trim(0)`` releases every whole free page of every arena (``MADV_DONTNEED``): the
pages leave the resident set and come back, zero-filled, only when a request touches them.
FSDP calls it on the CPU once per backward, where backward starts (the first unit's
pre-backward, unit.py): every activation is alive then, so that is about where the step's peak
is built, and the free resident heap at that moment is pure slack (what the last step freed and
forward did not take again). Not at every unit's backward start: from there on backward frees
activations as fast as it makes gradients, which take those freed blocks again, so releasing
them made the kernel clear the same pages once more for each unit, three times the page faults
of one release per step, for a peak only a little lower (docs/benchmarks-history.md). Not when
forward starts: since each unit keeps its reduced gradients' buffer across steps ([Note: a
reduced-gradient buffer kept across steps], kept_buffer.py), the free heap then is what
forward's activations take again at once. It changes no value, only which pages are resident.
Where the C library has no ``malloc_trim`` (not glibc) it does nothing.

``release_pages`` does the same for pages of memory that is still allocated but whose contents
are dead: ``madvise(MADV_DONTNEED)`` on the whole pages inside a tensor (Linux only); they read
as zeros if touched again.

[Note: heap kept resident across steps]
glibc's dynamic thresholds (above) also cost time. They start low (mmap at 128 KiB, trimming of the
heap's top at 128 KiB) and rise only as far as the largest mmap'd block freed so far. A model
whose largest gradients are 4 MiB leaves them at 4 MiB and 8 MiB, so whenever more than 8 MiB
at the top of the heap is free at once, ``free`` hands it back (``brk``) and the next
allocations fault it in again, a zero-filled page per 4 KiB. ZeRO stage 2 frees each gradient
in its hook, during backward, while backward frees the activations below them; nothing live
sits above that free memory, and the heap top shrinks and grows again by tens of MiB each step
(stage 1 and DDP keep their gradients until ``zero_grad``, and those hold the top).
``keep_heap_resident`` moves glibc's rule to where it ends in any program that has freed a
block of its largest dynamic mmap threshold (32 MiB on 64-bit): it allocates and frees one
block just under that size (only its header page is written), once per process. glibc then
serves blocks up to 32 MiB from the heap and trims its top only beyond 64 MiB free. No value
changes, and only free memory that the next step would fault in again stays resident (peak RSS
follows the live peak as before). Where the thresholds were set explicitly (``mallopt``,
``MALLOC_MMAP_THRESHOLD_`` and the like) glibc's dynamic rule is off and this changes nothing;
without glibc it does nothing. ZeroRedundancyOptimizer calls it on the CPU (zero/optimizer.py),
so ZeRO stage 1 and ZeroDataParallel (stage 2, built on that optimizer) run with it.
"""

from __future__ import annotations

import mmap

import torch

from shardwise.distributed.host import libc

# Give the C heap's free pages back to the OS (see [Note: allocator slack]); whether the C
# library could (False: not glibc, nothing done). The C library's call itself: nothing to add.
release_free_heap = libc.malloc_trim

# Raise glibc's dynamic mmap and trim thresholds to their largest values, once per process (see
# [Note: heap kept resident across steps]); whether it could (False: not glibc).
keep_heap_resident = libc.keep_heap_resident


def release_pages(tensor: torch.Tensor) -> int:
    """Hand the whole pages inside a contiguous CPU tensor's bytes back to the OS (see [Note:
    releasing a dead parameter's rows], fsdp/unit.py): they leave the resident set, and read
    as zeros if touched again. Only for memory nothing will read before it is written or
    freed. Returns the bytes released (0 where ``madvise`` is not available)."""
    if not libc.can_release_pages() or tensor.device.type != "cpu" \
            or not tensor.is_contiguous():
        return 0
    page = mmap.PAGESIZE
    begin = tensor.data_ptr()
    start = -(-begin // page) * page  # whole pages only: the first and last may be shared
    end = (begin + tensor.numel() * tensor.element_size()) // page * page
    if end <= start or not libc.madvise_dontneed(start, end - start):
        return 0
    return end - start
