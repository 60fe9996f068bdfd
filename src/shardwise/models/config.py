"""The demo GPT's shape (torch-free: the command line reads its defaults and counts its
parameters without importing torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    tie_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )

    def to_dict(self) -> dict:
        return asdict(self)
