"""The one error class of checkpoints (re-exported by ``shardwise.checkpoint``)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged, or does not fit this run."""
