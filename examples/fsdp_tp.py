"""FSDP x tensor parallelism on a 2D mesh (2 data-parallel x 2 tensor-parallel ranks), from
docs/mesh.md.

nproc: 4

The demo GPT's attention and MLP weights are split over the "tp" axis with ``shard_module``,
then each block and the root are sharded over the "dp" axis with ``fully_shard``. The two
data-parallel groups train on different batches. Checks every step's loss against one process
that trains the plain GPT on both batches together.

    shardwise run --nproc 4 examples/fsdp_tp.py
"""

import torch
import torch.distributed as dist

from shardwise.distributed import init
from shardwise.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
STEPS, DP, TOLERANCE = 4, 2, 1e-4


def dp_batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each data-parallel group's batches (the tp ranks of a group see the same ones)."""
    gen = torch.Generator().manual_seed(10 + dp_rank)
    tokens = [torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=gen)
              for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def new_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def reference_losses() -> list[float]:
    """One process, the plain GPT, both groups' batches at once (the mean over dp)."""
    model = new_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    both = [dp_batches(d) for d in range(DP)]
    losses = []
    for step in range(STEPS):
        x = torch.cat([b[step][0] for b in both])
        y = torch.cat([b[step][1] for b in both])
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    init()
    model = new_model()
    losses = []
    # block: fsdp_tp
    import torch

    import shardwise.sharded_tensor as st
    from shardwise import fully_shard
    from shardwise.distributed import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))   # torch's or ours
    tp = mesh["tp"].get_group()
    ranks = torch.distributed.get_process_group_ranks(tp)  # placements name global ranks
    colwise, rowwise = st.ChunkShardingSpec(0, ranks), st.ChunkShardingSpec(1, ranks)
    st.shard_module(model, {                     # or torch's parallelize_module(model, mesh["tp"])
        "tok_emb": colwise, "pos_emb": rowwise, "head": colwise,
        "blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise,
        "blocks.*.mlp.fc1": colwise, "blocks.*.mlp.fc2": rowwise,
    }, gather_output=["head"], process_group=tp)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])          # or FullyShardedDataParallel(device_mesh=...)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in dp_batches(mesh.get_local_rank("dp")):
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # one norm over both axes
        opt.step()
        opt.zero_grad()
    # block: end
        losses.append(loss.item())
    check(losses)


def check(losses: list[float]) -> None:
    """The mean of the dp groups' losses, step by step, against the single-process run."""
    mean = torch.tensor(losses) / DP
    dist.all_reduce(mean)
    mean /= dist.get_world_size() // DP  # every tp rank of a group added the same loss
    ref = torch.tensor(reference_losses())
    rel = ((mean - ref).abs() / ref.abs()).max().item()
    if not rel <= TOLERANCE:
        raise SystemExit(f"losses {mean.tolist()} differ from one process's {ref.tolist()} "
                         f"(max rel {rel:.1e})")
    if dist.get_rank() == 0:
        print("losses: " + " ".join(f"{v:.4f}" for v in mean.tolist()))
        print(f"ok: FSDP x TP on a 2x2 mesh trains as one process does (max rel diff {rel:.1e})")


if __name__ == "__main__":
    main()
