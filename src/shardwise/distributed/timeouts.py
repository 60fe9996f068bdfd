"""Timeouts for rendezvous and collectives.

Every process group shardwise creates carries a timeout, so that a dead or missing rank turns into
an error on the others instead of a hang. The default can be changed for a whole run through the
environment variable ``SHARDWISE_TIMEOUT`` (seconds).
"""

from __future__ import annotations

import os
from datetime import timedelta

ENV_VAR = "SHARDWISE_TIMEOUT"
DEFAULT_SECONDS = 300.0


def default_timeout() -> timedelta:
    """The timeout used when a caller gives none: ``$SHARDWISE_TIMEOUT`` or 300 seconds."""
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return timedelta(seconds=DEFAULT_SECONDS)
    try:
        seconds = float(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR} must be a number of seconds, got {raw!r}") from exc
    return as_timedelta(seconds)


def as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """Normalise a timeout given in seconds or as a timedelta; ``None`` means the default."""
    if timeout is None:
        return default_timeout()
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout.total_seconds()} s")
    return timeout
