"""A local shard: a tensor and the metadata saying which box of the global tensor it holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.sharded_tensor.metadata import ShardingError, ShardMetadata


@dataclass
class Shard:
    """Same fields as ``torch.distributed._shard.sharded_tensor.Shard``."""

    tensor: torch.Tensor  # shape == metadata.shard_sizes
    metadata: ShardMetadata

    def __post_init__(self) -> None:
        if tuple(self.tensor.shape) != self.metadata.shard_sizes:
            raise ShardingError(
                f"shard {self.metadata.describe()}: its tensor has size {tuple(self.tensor.shape)}"
                f" but its metadata says {self.metadata.shard_sizes}"
            )

    @classmethod
    def from_tensor_and_offsets(cls, tensor: torch.Tensor, shard_offsets: list[int],
                                rank: int) -> Shard:
        meta = ShardMetadata(tuple(shard_offsets), tuple(tensor.shape),
                             f"rank:{rank}/{tensor.device}")
        return cls(tensor, meta)
