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
FSDP calls it when a unit's backward starts on the CPU (unit.py), just before the unit gathers
its parameters and its gradients are made, so that the backward peak is built on a heap holding
no free resident pages. It changes no value, only which pages are resident. Where the C
library has no ``malloc_trim`` (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim``, looked up once; None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # no C library found, or not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (see [Note: allocator slack]); whether the
    C library could (False: not glibc, nothing done)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
