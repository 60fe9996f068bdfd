"""The launcher and its agent: N ranks of one command per node (``shardwise run``), the
rank's first code (rank_boot.py, bootstrap.py), the lifeline and the guard, failure records and
blame, progress records and the watchdog, several nodes agreeing on one job, preemption.

It may import only ``shardwise.distributed`` (the environment's readers, timeouts, signed store
records, private files), the standard library and torch; tests/test_layering.py checks. Design:
docs/launcher.md.
"""

from shardwise._lazy import lazy_names

# imported on first use: the launcher's flags and readers cost no torch import
lazy_names(__name__, {"launch": "shardwise.launch.launcher",
                      "python_command": "shardwise.launch.launcher"})

__all__ = ["launch", "python_command"]
