"""For tests that watch the gathers themselves (their buffers, their bytes, their release):
units built inside ``gathering_units()`` gather over the process group even where their ranks
share a host ([Note: parameters shared on one host], shardwise/fsdp/host_params.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from shardwise.fsdp.host_params import DISABLE_VAR


@contextmanager
def gathering_units() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DISABLE_VAR, "1")
        yield
