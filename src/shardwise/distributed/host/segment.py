"""Shared-memory segments: the one place in shardwise that creates and maps them.

Every segment is a file in ``/dev/shm`` private to this user (created with ``O_EXCL`` and mode
0600 under a name with 64 random bits, so it cannot be guessed or planted beforehand), mapped
``MAP_SHARED`` by the processes that share it and unlinked as soon as they all have it, so a
crash later leaves nothing behind. Two ways to make one:

- ``SharedSegment``, collective over a process group: rank 0 creates the file and reserves its
  pages (``posix_fallocate``: a full /dev/shm is an error at creation, never a bus error when
  a page is first touched); the name is broadcast as bytes (nothing is unpickled); every rank
  maps it, and after a barrier rank 0 unlinks it. Users: the same-host gradient reduction
  (dp/shm_reduce.py, and through it ZeRO's), the note board (peers.py) and FSDP's parameters
  shared on one host (fsdp/host_params.py).
- ``create_private`` / ``map_private`` / ``open_private``, between two processes that agree on a
  name by other means (RPC's shared-memory channel, rpc/wire/shm_channel.py): one side creates
  the file (also ``O_NOFOLLOW``), the other opens it, checks that it is a regular file of this
  user, private, with one link and the expected size, maps it and unlinks the name.

[Note: memory ordering on one host]
The mechanisms above the segments signal with plain stores into the shared pages: the data
first, then a word that says it is there. A peer that sees the word must also see the data, so
the paths that rely on it run only where the machine keeps stores in program order as other
cores see them (x86-64: ``stores_in_order``); elsewhere they are not chosen and the process
group carries the bytes (or, for RPC, the TCP connection). Where a protocol also needs a store
ordered before a later load (a sleeper's flag against the other side's cursor, RPC's ring), it
takes a full fence, ``Fence``.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import shutil
import stat
import threading
from contextlib import suppress

import torch
import torch.distributed as dist

from shardwise.distributed.groups import global_rank

SHM_DIR = "/dev/shm"
_PRIVATE_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SegmentError(OSError):
    """A segment could not be created, or the file found under its name is not ours."""


def room_for(nbytes: int) -> bool:
    """Whether /dev/shm has room for ``nbytes`` more (with a margin for the peers' own use)."""
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError:
        return False
    return free >= nbytes + nbytes // 8


class SharedSegment:
    """The shared mapping: created and named by rank 0, mapped by all, then unlinked.

    Collective over ``group`` (a broadcast and a barrier). ``purpose`` names the user in the
    error raised when rank 0 cannot reserve the pages; ``disable_var`` is the environment
    variable that turns that user's path off."""

    def __init__(self, nbytes: int, group: dist.ProcessGroup, purpose: str, disable_var: str):
        rank = dist.get_rank(group)
        name = torch.zeros(64, dtype=torch.uint8)  # all zeros: rank 0 could not make it
        path, failed = None, None
        if rank == 0:
            path = os.path.join(SHM_DIR, f"shardwise-{os.getpid()}-{secrets.token_hex(8)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.close(fd)
                _unlink(path)
                failed = exc
            else:
                raw = path.encode()
                name[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        try:
            dist.broadcast(name, src=global_rank(group, 0), group=group)
            if not bool(name.any()):
                raise RuntimeError(
                    f"{purpose}: rank 0 could not reserve {nbytes} bytes in {SHM_DIR} "
                    f"({failed or 'see rank 0'}); enlarge it (docker run --shm-size) or set "
                    f"{disable_var}=1 to use the process group instead")
            if rank != 0:
                path = bytes(name[name.nonzero().flatten()].tolist()).decode()
                fd = os.open(path, os.O_RDWR)
            try:
                self.map = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            dist.barrier(group=group)  # everyone has mapped it: the name is no longer needed
        finally:
            if rank == 0 and path is not None:
                _unlink(path)
        self.nbytes = nbytes

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1D tensor over ``numel`` elements of the mapping from byte ``offset``."""
        return torch.frombuffer(self.map, dtype=dtype, count=numel, offset=offset)

    def close(self) -> None:
        with suppress(BufferError):  # a tensor still views it: unmapped with the last one
            self.map.close()


def _unlink(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def stores_in_order() -> bool:
    """Whether this machine keeps stores in program order as other cores see them (x86-64),
    so that a peer that sees a flag word in a shared mapping also sees what was written
    before it: what the shared-memory paths that signal with plain stores need."""
    return platform.machine().lower() in ("x86_64", "amd64")


class Fence:
    """A full memory barrier ([Note: memory ordering on one host]): taking and releasing a lock
    is an atomic read-modify-write (a locked instruction on x86), which orders every earlier
    load and store before every later one; Python offers no other portable fence. Each user
    holds a fence of its own, used by one thread at a time, so the lock is never contended (no
    system call)."""

    def __init__(self) -> None:
        lock = threading.Lock()
        self._acquire, self._release = lock.acquire, lock.release

    def __call__(self) -> None:
        self._acquire()
        self._release()


# ---- segments between two processes that agree on a name by other means --------------------
def path_of(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create_private(name: str) -> int:
    """Create segment ``name`` (mode 0600, must not exist, no link followed); its descriptor."""
    try:
        return os.open(path_of(name), _PRIVATE_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise SegmentError(f"cannot create shared-memory segment {name}: {exc}") from exc


def map_private(fd: int, size: int, populate: bool = False) -> mmap.mmap:
    """Map ``size`` bytes of the segment open on ``fd``, shared and writable."""
    flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def open_private(name: str, size: int, populate: bool = True) -> mmap.mmap:
    """Map segment ``name`` after checking it (a regular file of this user, private, one link,
    ``size`` bytes); unlink it."""
    try:
        fd = os.open(path_of(name), _PRIVATE_FLAGS)
    except OSError as exc:
        raise SegmentError(f"cannot open shared-memory segment {name}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 \
                or st.st_nlink != 1:
            raise SegmentError(f"shared-memory segment {name} is not a private file of this "
                               f"user (mode {st.st_mode:o}, uid {st.st_uid})")
        if st.st_size != size:
            raise SegmentError(f"shared-memory segment {name} holds {st.st_size} bytes, the "
                               f"frame declares {size}")
        return map_private(fd, size, populate)
    finally:
        os.close(fd)
        unlink_private(name)


def unlink_private(name: str) -> None:
    """Remove segment ``name``'s name (gone already: nothing to do)."""
    _unlink(path_of(name))
