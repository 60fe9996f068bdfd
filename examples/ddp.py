"""DistributedDataParallel with gradient accumulation (``no_sync``): the README's first example.

Each rank trains the same small regression model on its own batches; every step accumulates
one micro-batch locally under ``no_sync()`` and averages gradients across ranks on the second.
Checks that the loss goes down and that every rank ends with the same parameters.

    shardwise run --nproc 2 examples/ddp.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn

torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batches(rank: int, steps: int = 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches per step of y = sum(x), different on every rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(2, 16, 8, generator=gen)
        out.append((x, x.sum(-1, keepdim=True)))
    return out


loss_fn = nn.functional.mse_loss
batches = make_batches(int(os.environ.get("RANK", "0")), steps=50)
x_eval = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
y_eval = x_eval.sum(-1, keepdim=True)


def main() -> None:
    # block: ddp
    import torch

    import shardwise
    from shardwise.distributed import init

    group = init()  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT; gloo on CPU, NCCL on CUDA
    model = shardwise.DistributedDataParallel(MyModel(), process_group=group, bucket_cap_mb=25)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for x, y in batches:
        with model.no_sync():                      # accumulate without communicating
            loss_fn(model(x[0]), y[0]).backward()
        loss_fn(model(x[1]), y[1]).backward()      # gradients averaged across ranks here
        opt.step()
        opt.zero_grad()
    # block: end
    check(model)


def check(model: nn.Module) -> None:
    """Every rank holds the same parameters, and the held-out loss went down."""
    torch.manual_seed(0)
    with torch.no_grad():
        before = loss_fn(MyModel()(x_eval), y_eval).item()  # the model DDP started from
        after = loss_fn(model(x_eval), y_eval).item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if not all(torch.equal(copies[0], c) for c in copies):
        raise SystemExit("ranks disagree on the parameters")
    if not after < before:
        raise SystemExit(f"held-out loss did not go down: {before:.4f} -> {after:.4f}")
    if dist.get_rank() == 0:
        print(f"ok: held-out loss {before:.3f} -> {after:.3f}, ranks agree on the parameters")


if __name__ == "__main__":
    main()
