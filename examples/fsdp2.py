"""FSDP2's ``fully_shard`` with bf16 mixed precision and meta-device initialisation, from the
README.

The model is built on the meta device (no memory), each layer and then the root are sharded
with the same mixed-precision policy, and ``to_empty`` gives every rank its shards, which the
model's own ``init_weights`` then fills. A few steps of next-token training on a fixed batch
follow. Checks that the loss goes down; the script runs unchanged with torch's own
``torch.distributed.fsdp`` in place of ``shardwise``.

    shardwise run --nproc 2 examples/fsdp2.py
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import init


@dataclass
class ModelArgs:
    vocab: int = 64
    dim: int = 32
    n_heads: int = 2
    n_layers: int = 2


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(args.dim, args.n_heads, 4 * args.dim, dropout=0.0,
                                       batch_first=True)
            for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def init_weights(self) -> None:
        """Fill every parameter; after ``to_empty`` this writes each rank's local shards."""
        torch.manual_seed(0)
        for name, param in self.named_parameters():
            if param.ndim >= 2:
                nn.init.normal_(param, std=0.02)
            elif "norm" in name and name.endswith("weight"):
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of one repeating sequence per rank: inputs and next tokens."""
    data = torch.arange(17).repeat(4, 1) * (rank + 1) % vocab
    return data[:, :-1], data[:, 1:]


def main() -> None:
    init()
    args = ModelArgs()
    x, y = batch(dist.get_rank(), args.vocab)
    # block: fsdp2
    import torch

    from shardwise import FSDPModule, MixedPrecisionPolicy, fully_shard  # was torch's fsdp

    with torch.device("meta"):
        model = Transformer(args)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)   # mesh=init_device_mesh("cpu", (2, 2)) for HSDP
    assert isinstance(model, FSDPModule)
    model.to_empty(device="cpu")
    model.init_weights()                      # the model's own init, on the local shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm, on every rank
        opt.step()
        opt.zero_grad()
    # block: end
        print(f"rank {dist.get_rank()} loss {loss.item():.4f}")
        losses.append(loss.item())
    if not losses[-1] < losses[0] - 0.1:
        raise SystemExit(f"loss did not go down: {losses}")
    if dist.get_rank() == 0:
        print(f"ok: loss {losses[0]:.3f} -> {losses[-1]:.3f} under fully_shard with bf16")


losses: list[float] = []

if __name__ == "__main__":
    main()
