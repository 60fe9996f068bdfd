"""One shared-memory mapping for the ranks of a group on one host.

Rank 0 creates the file in ``/dev/shm`` with mode 0600 under a random name and reserves its
pages (``posix_fallocate``: a full /dev/shm is an error at creation, never a bus error when a
page is first touched); the name is broadcast as bytes (nothing is unpickled); every rank maps
it, and after a barrier rank 0 unlinks it, so a crash later leaves nothing behind. Users: the
same-host gradient reduction (shm_reduce.py) and FSDP's parameters shared on one host
(fsdp/host_params.py).
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import shutil
from contextlib import suppress

import torch
import torch.distributed as dist

from shardwise.distributed.groups import global_rank

SHM_DIR = "/dev/shm"


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
