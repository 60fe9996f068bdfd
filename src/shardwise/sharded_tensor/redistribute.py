"""Moving a tensor's elements from one set of shards to another with one ``all_to_all_single``.

Scatter (one shard on the source rank -> a spec), gather (a spec -> one shard on the
destination), all-gather (a spec -> a whole copy on every rank) and reshard (spec A -> spec B,
chunked or enumerable) are all the same operation: intersect every source box with every target
box, send each non-empty intersection from the rank holding the source to the rank holding the
target. The plan is pure (``plan_pieces``); both sides walk it in the same order, so one
collective carries every piece and no sizes need to be exchanged. Pieces that stay on a rank are
copied locally and never enter the collective; when no piece leaves any rank, no collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.sharded_tensor import comm
from shardwise.sharded_tensor.metadata import ShardMetadata, overlap


@dataclass(frozen=True)
class Piece:
    src: int  # index into the source shards
    dst: int  # index into the target shards
    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]  # in the global tensor
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def plan_pieces(src: Sequence[ShardMetadata], dst: Sequence[ShardMetadata]) -> list[Piece]:
    """Every non-empty intersection of a source and a target box, ordered by (target, source)."""
    pieces = []
    for j, d in enumerate(dst):
        for i, s in enumerate(src):
            box = overlap(s, d)
            if box is not None:
                pieces.append(Piece(i, j, s.rank, d.rank, *box))
    return pieces


def _local_view(t: torch.Tensor, shard: ShardMetadata, piece: Piece) -> torch.Tensor:
    for dim, (o, n, so) in enumerate(zip(piece.offsets, piece.sizes, shard.shard_offsets)):
        t = t.narrow(dim, o - so, n)
    return t


def redistribute(local: dict[int, torch.Tensor], src: Sequence[ShardMetadata],
                 dst: Sequence[ShardMetadata], rank: int, world_size: int, group,
                 like: torch.Tensor) -> dict[int, torch.Tensor]:
    """This rank's target shards (index into ``dst`` -> tensor), filled from the source shards
    ``local`` (index into ``src`` -> tensor) of every rank. Not differentiable."""
    pieces = plan_pieces(src, dst)
    out = {j: like.new_empty(d.shard_sizes, device=like.device)
           for j, d in enumerate(dst) if d.rank == rank}
    remote = [p for p in pieces if p.src_rank != p.dst_rank]
    for p in pieces:
        if p.src_rank == rank and p.dst_rank == rank:
            _local_view(out[p.dst], dst[p.dst], p).copy_(_local_view(local[p.src], src[p.src], p))
    if not remote:
        return out
    send_counts, recv_counts = [0] * world_size, [0] * world_size
    parts = []
    for r in range(world_size):
        for p in remote:
            if p.src_rank == rank and p.dst_rank == r:
                parts.append(_local_view(local[p.src], src[p.src], p).reshape(-1))
                send_counts[r] += p.numel
            if p.dst_rank == rank and p.src_rank == r:
                recv_counts[r] += p.numel
    send = torch.cat(parts) if parts else like.new_empty(0)
    recv = comm.all_to_all_flat(send.to(like.dtype), send_counts, recv_counts, group)
    offset = 0
    for r in range(world_size):
        for p in remote:
            if p.dst_rank == rank and p.src_rank == r:
                view = _local_view(out[p.dst], dst[p.dst], p)
                view.copy_(recv[offset : offset + p.numel].view(p.sizes))
                offset += p.numel
    return out
