"""The peak memory a process has used, as the OS or the CUDA allocator reports it."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """Peak bytes of this process: CUDA's max allocated on a CUDA device, else peak RSS."""
    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
