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
FSDP calls it on the CPU when the root unit's forward starts (the optimizer step and the freed
gradients left their pages) and when each unit's backward starts (unit.py), just before the
unit gathers its parameters and its gradients are made, so that the forward and backward peaks
are built on a heap holding no free resident pages. It changes no value, only which pages are
resident. Where the C library has no ``malloc_trim`` (not glibc) it does nothing.

``release_pages`` does the same for pages of memory that is still allocated but whose contents
are dead: ``madvise(MADV_DONTNEED)`` on the whole pages inside a tensor (Linux only); they read
as zeros if touched again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
from collections.abc import Callable

import torch


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once; None where none is found."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim``, looked up once; None where there is none."""
    trim = getattr(_libc(), "malloc_trim", None)  # not glibc: none
    if trim is None:
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


_MADV_DONTNEED = 4  # Linux


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise``, looked up once; None where there is none or not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    advise = getattr(_libc(), "madvise", None)
    if advise is None:
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


def release_pages(tensor: torch.Tensor) -> int:
    """Hand the whole pages inside a contiguous CPU tensor's bytes back to the OS (see [Note:
    releasing a dead parameter's rows], fsdp/unit.py): they leave the resident set, and read
    as zeros if touched again. Only for memory nothing will read before it is written or
    freed. Returns the bytes released (0 where ``madvise`` is not available)."""
    advise = _madvise()
    if advise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    page = mmap.PAGESIZE
    begin = tensor.data_ptr()
    start = -(-begin // page) * page  # whole pages only: the first and last may be shared
    end = (begin + tensor.numel() * tensor.element_size()) // page * page
    if end <= start or advise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start
