"""The one binding of the C library through ``ctypes``: each call shardwise makes into libc.

Standard library only: the launcher's rank_boot.py loads lifeline.py, and lifeline.py loads this
file by its path, before torch or shardwise's package is imported. Each C symbol is looked up
once (when this file loads, or on first use); where it is missing (not Linux, not glibc, an old
libc) the functions say so and the callers keep their slower path. ``ctypes`` releases the GIL
for every call, so other threads go on meanwhile.

- ``read_peer`` (``process_vm_readv``): bytes out of another process's memory (peers.py);
- ``futex_wait`` / ``futex_wake`` (``syscall(SYS_futex)``, x86-64): sleeping on a word of a
  shared mapping and waking its sleepers (peers.py);
- ``malloc_trim``, ``keep_heap_resident`` and ``madvise_dontneed``: the C heap (memory/heap.py);
- ``die_with_parent`` (``prctl(PR_SET_PDEATHSIG)``): the launcher's lifeline.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform
import sys

_LINUX = sys.platform.startswith("linux")
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not the private variants
_MADV_DONTNEED = 4  # Linux
_PR_SET_PDEATHSIG = 1
# glibc's largest dynamic mmap threshold: 4 MiB times sizeof(long)
_DYNAMIC_MMAP_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library as this process already has it (the symbols of the program and the
    libraries it loaded, libc among them: no search for the file), opened once, errno kept for
    the callers that read it; None where that is not possible."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _symbol(name: str, linux_only: bool = True):
    if linux_only and not _LINUX:
        return None
    return getattr(_libc(), name, None)


# ---- another process's memory ----------------------------------------------------------------
class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind_readv():
    fn = _symbol("process_vm_readv")
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _bind_readv()


def can_read_peers() -> bool:
    """Whether this C library has ``process_vm_readv`` (Linux)."""
    return _READV is not None


def read_peer(pid: int, dest: int, address: int, size: int) -> tuple[int, int]:
    """Copy ``size`` bytes at ``address`` in process ``pid`` to ``dest`` in ours: the bytes
    copied (negative on failure) and the error number (0 where none)."""
    local, remote = _IoVec(dest, size), _IoVec(address, size)
    got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return got, (ctypes.get_errno() if got < 0 else 0)


# ---- futex words in a shared mapping ---------------------------------------------------------
class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def _bind_syscall():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # the system call's number is x86-64's
    fn = _symbol("syscall")
    if fn is not None:
        fn.restype = ctypes.c_long
    return fn


_SYSCALL = _bind_syscall()


def has_futex() -> bool:
    """Whether futex calls are available here (Linux on x86-64)."""
    return _SYSCALL is not None


def pause(seconds: float):
    """A wait's bound for ``futex_wait``, made once by a waiter and passed to every call."""
    return ctypes.byref(_Timespec(int(seconds), int(seconds % 1 * 1e9)))


def futex_wait(address: int, value: int, bound) -> None:
    """Sleep while the 32-bit word at ``address`` holds ``value``, at most ``bound``
    (``pause``); returns early when woken, or at once when the word differs."""
    _SYSCALL(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(_FUTEX_WAIT),
               ctypes.c_long(value), bound, ctypes.c_void_p(0), ctypes.c_long(0))


def futex_wake(address: int) -> None:
    """Wake every sleeper on the 32-bit word at ``address`` (one system call, whether or not
    one sleeps; every argument passed as 64 bits: ``syscall`` is variadic)."""
    _SYSCALL(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(_FUTEX_WAKE),
               ctypes.c_long(2**31 - 1), None, ctypes.c_void_p(0), ctypes.c_long(0))


# ---- the C heap ------------------------------------------------------------------------------
@functools.cache
def _malloc_trim():
    trim = _symbol("malloc_trim", linux_only=False)  # not glibc: none
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def malloc_trim() -> bool:
    """``malloc_trim(0)``: the heap's free pages back to the OS; whether libc could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def keep_heap_resident() -> bool:
    """Raise glibc's dynamic mmap and trim thresholds to their largest values, once per process
    ([Note: heap kept resident across steps], memory/heap.py); whether it could (glibc)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    malloc, free = libc.malloc, libc.free
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    # an mmap'd chunk is the request plus a header, rounded up to a page: stay under the maximum
    block = malloc(_DYNAMIC_MMAP_MAX - 2 * mmap.PAGESIZE)
    if not block:
        return False
    free(block)  # glibc's rule: mmap threshold = this chunk's size, trim threshold = twice that
    return True


@functools.cache
def _madvise():
    advise = _symbol("madvise")
    if advise is not None:
        advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        advise.restype = ctypes.c_int
    return advise


def can_release_pages() -> bool:
    """Whether ``madvise_dontneed`` is available (Linux)."""
    return _madvise() is not None


def madvise_dontneed(start: int, length: int) -> bool:
    """``madvise(MADV_DONTNEED)`` on whole pages: they leave the resident set; whether it
    succeeded."""
    return _madvise()(start, length, _MADV_DONTNEED) == 0


# ---- the process --------------------------------------------------------------------------------
def die_with_parent(sig: int) -> None:
    """Ask the kernel to send this process ``sig`` when its parent dies (Linux; elsewhere
    nothing)."""
    prctl = _symbol("prctl")
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
