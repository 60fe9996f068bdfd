"""Timeouts for rendezvous and collectives.

Every process group shardwise creates carries a timeout, so that a dead or missing rank turns into
an error on the others instead of a hang. The default can be changed for a whole run through the
environment variable ``SHARDWISE_TIMEOUT`` (seconds: positive and finite).
"""

from __future__ import annotations

import math
from datetime import timedelta

from shardwise.distributed.env import seconds_var

ENV_VAR = "SHARDWISE_TIMEOUT"
DEFAULT_SECONDS = 300.0


def default_timeout() -> timedelta:
    """The timeout used when a caller gives none: ``$SHARDWISE_TIMEOUT`` or 300 seconds."""
    return timedelta(seconds=seconds_var(ENV_VAR, DEFAULT_SECONDS))


def as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """Normalise a timeout given in seconds or as a timedelta; ``None`` means the default."""
    if timeout is None:
        return default_timeout()
    if not isinstance(timeout, timedelta):
        seconds = float(timeout)
        if not math.isfinite(seconds):
            raise ValueError(f"timeout must be a finite number of seconds, got {timeout}")
        timeout = timedelta(seconds=seconds)
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout.total_seconds()} s")
    return timeout
