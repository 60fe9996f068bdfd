"""Reading the launch environment that torchrun (and our own launcher) sets for each rank.

Every environment variable shardwise reads goes through ``int_var``, ``seconds_var`` or
``flag_var`` here, so that a malformed value is an error that names the variable and what it must
be, rather than a conversion error from deep inside.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

# The launcher hosts the TCPStore itself and tells ranks so, as torchrun's agent does.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
# The RPC group secret (shardwise.rpc's handshake): set by `shardwise run` on one host, by the
# user across hosts; never written to the store ([Note: group secret] in rpc/secret.py).
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
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
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
        raise EnvError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"environment variable {name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EnvError(f"environment variable {name} must be at most {maximum}, got {value}")
    return value


def seconds_var(name: str, default: float) -> float:
    """``$name`` as a positive, finite number of seconds; ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(
            f"environment variable {name} must be a number of seconds, got {raw!r}"
        ) from None
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
