"""Memory: the library's own byte accounting of model state, and measured process peaks."""

from shardwise._lazy import lazy_names

# imported on first use: the estimates' tables and activation formulas cost no torch import
lazy_names(__name__, {"StateBytes": "shardwise.memory.accounting",
                      "state_bytes": "shardwise.memory.accounting",
                      "peak_memory_bytes": "shardwise.memory.peak"})

__all__ = ["StateBytes", "peak_memory_bytes", "state_bytes"]
