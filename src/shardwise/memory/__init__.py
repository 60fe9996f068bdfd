"""Memory: the library's own byte accounting of model state, and measured process peaks."""

from shardwise.memory.accounting import StateBytes, state_bytes
from shardwise.memory.peak import peak_memory_bytes

__all__ = ["StateBytes", "peak_memory_bytes", "state_bytes"]
