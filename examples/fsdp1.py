"""FSDP1's wrapper style, ``FullyShardedDataParallel`` with an auto-wrap policy, from the README.

Each transformer block of the demo GPT becomes its own FSDP unit (``ModuleWrapPolicy``), with
bf16 compute. Every step accumulates one micro-batch under ``no_sync()``, clips the global
gradient norm and steps; at the end rank 0 gathers the full state dict and loads it into a
plain, unwrapped GPT. Checks that the loss goes down and that the gathered model computes what
the sharded one does.

    shardwise run --nproc 2 examples/fsdp1.py
"""

import torch
import torch.distributed as dist

from shardwise.distributed import init
from shardwise.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)  # the block's


def make_batches(rank: int, steps: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same two micro-batches every step (a batch the model can learn), one pair per rank."""
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 4, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)  # the model's initial weights, the same on every rank
    return [(tokens[:, :, :-1], tokens[:, :, 1:])] * steps


def main() -> None:
    init()
    batches = make_batches(dist.get_rank())
    # block: fsdp1
    import torch

    import shardwise
    from shardwise.fsdp import ModuleWrapPolicy, full_state_dict
    from shardwise.models import GPT, GPTConfig, lm_loss
    from shardwise.models.gpt import Block

    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    model = shardwise.FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16))  # optional
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # original names, local shards
    for x, y in batches:
        with model.no_sync():                              # accumulate without communicating
            lm_loss(model(x[0]), y[0]).backward()
        lm_loss(model(x[1]), y[1]).backward()              # gradients reduce-scattered here
        model.clip_grad_norm_(1.0)                         # norm over all shards
        opt.step()
        opt.zero_grad()
    state = full_state_dict(model, rank0_only=True)        # loads into the plain model
    # block: end
    x, y = batches[0][0][1], batches[0][1][1]
    check(model, state, x, y)


def check(model: torch.nn.Module, state: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    """The loss on the trained batch went down from the initial model's; rank 0's gathered
    state dict, in a plain GPT, computes what the sharded model does."""
    torch.manual_seed(0)
    with torch.no_grad():
        before = lm_loss(GPT(CONFIG)(x), y).item()
        sharded = model(x).float()
    after = lm_loss(sharded, y).item()
    print(f"rank {dist.get_rank()} loss {before:.3f} -> {after:.3f}")
    if not after < before - 0.1:
        raise SystemExit(f"loss did not go down: {before:.4f} -> {after:.4f}")
    if dist.get_rank() == 0:
        plain = GPT(CONFIG).to(torch.bfloat16)  # computes in bf16, as the FSDP units do
        plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
        with torch.no_grad():
            gathered = plain(x).float()
        err = (gathered - sharded).abs().max().item()
        if err > 0.05 * sharded.abs().max().item():
            raise SystemExit(f"the gathered model computes something else: max diff {err:.3g}")
        print(f"ok: loss {before:.3f} -> {after:.3f}; the full state dict loads into a "
              f"plain GPT that matches the sharded model (max diff {err:.2g})")


if __name__ == "__main__":
    main()
