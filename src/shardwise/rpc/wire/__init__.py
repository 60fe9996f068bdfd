"""The wire: how bytes reach a peer and whom they come from.

transport.py (sockets: listening, dialing, one connection per peer) and connection.py (what the
socket and shared-memory connections share: who reads, who runs a call), frames.py (frames on a
stream socket), shm_channel.py over shm_ring.py and shm_pool.py (the shared-memory channel
between workers on one host), auth.py (the handshake), session.py (session keys and every
frame's MAC), device_maps.py and cuda_transfer.py (which device a tensor is sent from and lands
on).

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
