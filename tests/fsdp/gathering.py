"""For tests that watch the gathers themselves (their buffers, their bytes, their release):
units built inside ``gathering_units()`` gather over the process group even where their ranks
share a host ([Note: parameters shared on one host], shardwise/fsdp/host_params.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from shardwise.fsdp.host_params import DISABLE_VAR


@contextmanager
def gathering_units() -> Iterator[None]:
    before = os.environ.get(DISABLE_VAR)
    os.environ[DISABLE_VAR] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DISABLE_VAR, None)
        else:
            os.environ[DISABLE_VAR] = before
