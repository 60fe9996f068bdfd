"""The wire: frames (frames.py), the shared-memory channel (shm_channel.py over shm_ring.py
and shm_pool.py).

The frame names are re-exported here: ``shardwise.rpc.wire.FrameError`` and the rest are the
objects of frames.py themselves.
"""

from shardwise.rpc.wire.frames import (
    DEFAULT_MAX_MESSAGE,
    MAGIC,
    TAG,
    FrameError,
    FrameReader,
    PeerClosed,
    frame_parts,
    sealed,
    send_frame,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "MAGIC",
    "TAG",
    "FrameError",
    "FrameReader",
    "PeerClosed",
    "frame_parts",
    "sealed",
    "send_frame",
]
