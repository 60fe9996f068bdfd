"""Reading the launch environment that torchrun (and our own launcher) sets for each rank.

Every environment variable shardwise reads goes through a reader here (``int_var``,
``seconds_var``, ``flag_var``, ``choice_var``, ``str_var``, ``is_set``), so that a malformed value
is an error that names the variable and what it must be, rather than a conversion error from
deep inside. Writes are not reads: the launcher sets a rank's variables in the environment it
hands the rank (``child_environment()``, a copy of this process's, extended), and a process may
set or delete its own (``os.environ[K] = V``, ``update``, ``pop``) before it starts a child.
tests/test_env_reads.py scans src/ and fails on any other use of ``os.environ`` or ``os.getenv``.

Standard library only: rank_boot.py and lifeline.py load this file by its path before the
package (which imports torch) may be imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

# The launcher hosts the TCPStore itself and tells ranks so, as torchrun's agent does.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
# The RPC group secret (shardwise.rpc's handshake): set by `shardwise run` on one host, by the
# user across hosts; never written to the store ([Note: group secret] in rpc/trust/secret.py).
RPC_SECRET_VAR = "SHARDWISE_RPC_SECRET"
RPC_SECRET_FILE_VAR = "SHARDWISE_RPC_SECRET_FILE"


class EnvError(RuntimeError):
    """An environment variable shardwise reads is missing or malformed; the message names it."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # True: the launcher hosts the store, every rank is a client
    restart_count: int


def launched() -> bool:
    """True when RANK and WORLD_SIZE are set, i.e. a launcher started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def read_env() -> LaunchEnv:
    """Parse torchrun's variables; a missing or malformed one is an error naming it."""
    world_size = int_var("WORLD_SIZE", minimum=1)
    rank = int_var("RANK", minimum=0)
    if rank >= world_size:
        raise EnvError(f"environment variable RANK={rank} is not below WORLD_SIZE={world_size}")
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=int_var("LOCAL_RANK", default=rank, minimum=0),
        master_addr=str_var("MASTER_ADDR", "127.0.0.1"),
        master_port=int_var("MASTER_PORT", minimum=0, maximum=65535),
        agent_store=flag_var(AGENT_STORE_VAR),
        restart_count=int_var("TORCHELASTIC_RESTART_COUNT", default=0, minimum=0),
    )


def int_var(name: str, default: int | None = None, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """``$name`` as an integer in [minimum, maximum]; ``default`` when unset (None: required)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise EnvError(
                f"environment variable {name} is not set: start this script with torchrun, "
                "`shardwise run`, or pass rank and world_size explicitly"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"environment variable {name} must be an integer, got {raw!r}"
                       + _int_range(minimum, maximum)) from None
    if minimum is not None and value < minimum:
        raise EnvError(f"environment variable {name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EnvError(f"environment variable {name} must be at most {maximum}, got {value}")
    return value


def _int_range(minimum: int | None, maximum: int | None) -> str:
    """`` (accepted: ...)``: the integers an int_var takes, for its message."""
    if minimum is not None and maximum is not None:
        return f" (accepted: {minimum} to {maximum})"
    if minimum is not None:
        return f" (accepted: {minimum} or more)"
    return ""


def seconds_var(name: str, default: float) -> float:
    """``$name`` as a positive, finite number of seconds; ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise EnvError(
            f"environment variable {name} must be a positive, finite number of seconds, "
            f"got {raw!r}"
        )
    return value


def flag_var(name: str) -> bool:
    """``$name`` as a boolean: 1/true/yes or 0/false/no/empty (case-insensitive)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise EnvError(f"environment variable {name} must be 1/true/yes or 0/false/no, got {raw!r}")


def choice_var(name: str, choices: Sequence[str], default: str) -> str:
    """``$name`` (stripped, lower case) as one of ``choices``; ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        raise EnvError(f"environment variable {name} must be one of {', '.join(choices)}, "
                       f"got {raw!r}")
    return raw


def str_var(name: str, default: str | None = None) -> str | None:
    """``$name`` as it is set; ``default`` when unset or empty (an empty value means unset)."""
    raw = os.environ.get(name)
    return raw if raw else default


def is_set(name: str) -> bool:
    """True when ``$name`` is set to a non-empty value."""
    return bool(os.environ.get(name))


def child_environment(**extra: str) -> dict[str, str]:
    """A copy of this process's environment with ``extra`` set: what a child process is given
    (the launcher's ranks, a benchmark's workers)."""
    return {**os.environ, **extra}
