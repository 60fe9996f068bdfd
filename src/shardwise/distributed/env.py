"""Reading the launch environment that torchrun (and our own launcher) sets for each rank."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The launcher hosts the TCPStore itself and tells ranks so, as torchrun's agent does.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"


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
    return LaunchEnv(
        rank=_int_var("RANK"),
        world_size=_int_var("WORLD_SIZE"),
        local_rank=_int_var("LOCAL_RANK", default=_int_var("RANK")),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_var("MASTER_PORT"),
        agent_store=os.environ.get(AGENT_STORE_VAR, "").lower() in ("1", "true"),
        restart_count=_int_var("TORCHELASTIC_RESTART_COUNT", default=0),
    )


def _int_var(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set: start this script with torchrun, "
                "`shardwise run`, or pass rank and world_size explicitly"
            )
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise RuntimeError(f"environment variable {name} must be an integer, got {raw!r}") from exc
