"""Tensor parallelism by annotation: ``shard_module`` shards the demo GPT's attention and MLP
weights over the ranks, from the README, and ``st.randn`` makes a sharded tensor.

Checks that the sharded model computes the unsharded model's logits, that it trains (the loss
on a fixed batch goes down), and that the sharded random tensor equals ``torch.randn`` on one
process with the same seed.

    shardwise run --nproc 2 examples/tensor_parallel.py
"""

import torch
import torch.distributed as dist

from shardwise.distributed import init
from shardwise.models import GPT, GPTConfig, lm_loss


def tokens() -> torch.Tensor:
    return torch.randint(0, GPTConfig().vocab_size, (2, 33),
                         generator=torch.Generator().manual_seed(3))


def unsharded() -> GPT:
    """The unsharded model, from the seed the sharded one is built with."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    torch.manual_seed(0)
    return model


def main() -> None:
    group = init()
    reference = unsharded()
    # block: tensor_parallel
    import torch

    import shardwise.sharded_tensor as st
    from shardwise.models import GPT, GPTConfig

    ranks = torch.distributed.get_process_group_ranks(group)  # placements name global ranks
    colwise, rowwise = st.ChunkShardingSpec(0, ranks), st.ChunkShardingSpec(1, ranks)
    model = st.shard_module(GPT(GPTConfig()), {
        "blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise,
        "blocks.*.mlp.fc1": colwise, "blocks.*.mlp.fc2": rowwise,
    }, process_group=group)
    opt = torch.optim.AdamW(model.parameters())  # parameters() yields this rank's shards

    torch.manual_seed(1)              # the same seed on every rank
    x = st.randn(colwise, 8, 6)       # equals torch.randn(8, 6) on one process with the same seed
    full = x.reshard(rowwise).full_tensor()  # one all_to_all_single, then an all-gather
    # block: end
    check(model, reference, opt, full)


def check(model, reference, opt, full: torch.Tensor) -> None:
    batch = tokens()
    with torch.no_grad():
        diff = (model(batch[:, :-1]) - reference(batch[:, :-1])).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"the sharded GPT's logits differ from the unsharded one's by {diff:.3g}")
    torch.manual_seed(1)
    if not torch.equal(full, torch.randn(8, 6)):
        raise SystemExit("st.randn differs from torch.randn with the same seed")
    losses = []
    for _ in range(5):
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if not losses[-1] < losses[0] - 0.1:
        raise SystemExit(f"loss did not go down: {losses}")
    if dist.get_rank() == 0:
        print(f"ok: the sharded GPT's logits equal the unsharded one's (max diff {diff:.1g}); "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; st.randn equals torch.randn")


if __name__ == "__main__":
    main()
