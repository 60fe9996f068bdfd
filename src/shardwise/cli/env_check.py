"""The environment variables a user sets for shardwise, read once in the launching process, so
that a malformed value is one line (``shardwise run: error: environment variable ... must
be ...``, exit 2) before any rank starts rather than a traceback from every rank.

Each entry reads its variable with the reader and bounds the library uses where it reads it
(distributed/env.py's readers; the name constants live beside those reads, in modules that
import torch, so they are spelled here and tests/cli/test_mistakes.py checks that every
``SHARDWISE_*`` variable in src/ is either here or in ``NOT_CHECKED``).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.distributed.env import EnvError, choice_var, flag_var, int_var
from shardwise.distributed.timeouts import default_timeout
from shardwise.launch.preemption import grace_from_env

# variable -> its reader, with the bounds the library reads it with (only a set value is read
# here, so the default given is never used)
CHECKED: dict[str, Callable[[], object]] = {
    "SHARDWISE_TIMEOUT": default_timeout,  # distributed/timeouts.py
    "SHARDWISE_GRACE_SECONDS": grace_from_env,  # launch/preemption.py
    "SHARDWISE_NO_PEER_READ":  # distributed/host/peers.py
        lambda: flag_var("SHARDWISE_NO_PEER_READ"),
    "SHARDWISE_NO_SHM_REDUCE": lambda: flag_var("SHARDWISE_NO_SHM_REDUCE"),  # dp/shm_reduce.py
    "SHARDWISE_FSDP_NO_SHARED_PARAMS":  # fsdp/host_params.py
        lambda: flag_var("SHARDWISE_FSDP_NO_SHARED_PARAMS"),
    "SHARDWISE_RPC_CHANNEL":  # rpc/wire/shm_channel.py (MODES)
        lambda: choice_var("SHARDWISE_RPC_CHANNEL", ("auto", "tcp", "shm"), "auto"),
    "SHARDWISE_RPC_SHM_POOL_MB":  # rpc/wire/shm_channel.py
        lambda: int_var("SHARDWISE_RPC_SHM_POOL_MB", 0, minimum=0),
    "SHARDWISE_RPC_SPIN_US": lambda: int_var("SHARDWISE_RPC_SPIN_US", 0, minimum=0),
    "SHARDWISE_CHECKPOINT_MAX_METADATA_BYTES":  # checkpoint/format.py
        lambda: int_var("SHARDWISE_CHECKPOINT_MAX_METADATA_BYTES", 0, minimum=1),
}

# Free-form values (addresses, paths, secrets: nothing to be malformed), and what the launcher
# sets for its own ranks (read there, written here).
NOT_CHECKED = ("SHARDWISE_RPC_ADDR", "SHARDWISE_RPC_SECRET", "SHARDWISE_RPC_SECRET_FILE",
               "SHARDWISE_LAUNCH_SECRET", "SHARDWISE_LAUNCH_ID", "SHARDWISE_LAUNCHER_PID",
               "SHARDWISE_LAUNCHER_FD", "SHARDWISE_LIFELINE_ARMED", "SHARDWISE_PROGRESS_FD",
               "SHARDWISE_ATTEMPT_ID")


def env_problem() -> str | None:
    """The first malformed variable's one-line message, or None."""
    for read in CHECKED.values():
        try:
            read()
        except EnvError as exc:
            return str(exc)
    return None
