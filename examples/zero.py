"""ZeRO: a sharded optimizer (stage 1) and sharded gradients (stage 2), from the README.

Stage 1 wraps the model in DistributedDataParallel and gives the parameters to a
ZeroRedundancyOptimizer; stage 2 makes the optimizer first and wraps a fresh copy of the model
in ZeroDataParallel, which reduces each gradient to the rank that owns it. The stage-2 model
then trains a few steps; the consolidated optimizer state is saved on rank 0 and loaded into a
plain AdamW. Last, stage 2 again with the element partition (docs/zero.md). Checks that the
loss goes down and that every rank holds the same parameters, for both partitions.

    shardwise run --nproc 2 examples/zero.py
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import init

loss_fn = nn.functional.mse_loss


def MyModel() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def data(rank: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(16, 8, generator=gen) for _ in range(n)]
    return [t for x in xs for t in (x, x.mean(-1, keepdim=True))]


def main() -> None:
    init()
    rank = dist.get_rank()
    x0, y0, x1, y1 = data(rank, 2)
    net = MyModel()
    # block: zero
    import torch

    import shardwise

    # stage 1: any DDP, then the sharded optimizer
    model = shardwise.DistributedDataParallel(net)
    opt = shardwise.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=1e-3, weight_decay=0.01)

    # stage 2 (instead): the optimizer first, then the wrapper that knows who owns which gradient
    net = MyModel()
    opt = shardwise.ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=1e-3)
    model = shardwise.ZeroDataParallel(net, opt)       # replaces DistributedDataParallel
    with model.no_sync():                              # accumulate micro-batches locally
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()                  # gradients reduced to their owners
    model.clip_grad_norm_(1.0)                         # global norm over all shards
    opt.step()
    opt.zero_grad()

    # checkpoint: gather the whole state (keyed like a plain AdamW's) on rank 0; it loads at any
    # world size, or into a plain optimizer
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(opt.state_dict(), "opt.pt")
    # block: end
    train_and_check(model, opt, rank)
    by_elements(rank)


def by_elements(rank: int) -> None:
    """Stage 2 with the element partition: each rank steps an equal range of the flattened
    parameters, one all-gather per dtype after the step."""
    import shardwise

    net = MyModel()
    param_groups = [{"params": list(net.parameters())}]
    # block: zero-elements
    opt = shardwise.ZeroRedundancyOptimizer(param_groups, torch.optim.AdamW, lr=1e-3,
                                            partition="elements")
    model = shardwise.ZeroDataParallel(net, opt)      # stage 2; or DDP first for stage 1
    # block: end
    train_and_check(model, opt, rank, saved=False)


def train_and_check(model: nn.Module, opt: torch.optim.Optimizer, rank: int,
                    saved: bool = True) -> None:
    """More stage-2 steps; then every rank must hold the same parameters and the held-out loss
    must be below the initial model's; ``saved``: rank 0 also loads the consolidated state it
    saved into a plain AdamW."""
    for x, y in zip(*[iter(data(rank, 60))] * 2):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    x_eval, y_eval = data(99, 1)
    with torch.no_grad():
        before = loss_fn(MyModel()(x_eval), y_eval).item()
        after = loss_fn(model(x_eval), y_eval).item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if not all(torch.equal(copies[0], c) for c in copies):
        raise SystemExit("ranks disagree on the parameters")
    if not after < before:
        raise SystemExit(f"held-out loss did not go down: {before:.4f} -> {after:.4f}")
    if rank == 0 and not saved:
        print(f"ok: held-out loss {before:.4f} -> {after:.4f}, ranks agree")
    elif rank == 0:
        plain = torch.optim.AdamW(MyModel().parameters(), lr=1e-3)
        plain.load_state_dict(torch.load("opt.pt"))
        os.remove("opt.pt")
        print(f"ok: held-out loss {before:.4f} -> {after:.4f}, ranks agree, the consolidated "
              f"state loads into a plain AdamW ({len(plain.state)} parameters with state)")


if __name__ == "__main__":
    os.chdir(tempfile.mkdtemp())  # opt.pt is written here
    main()
