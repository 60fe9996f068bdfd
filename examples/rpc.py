"""RPC: a remote call, a remote module behind an RRef, and distributed autograd through it, from
the README.

worker0 adds on worker1, builds a ``MyModule`` there, runs its forward through the RRef and
backpropagates through the RPC into ``x``. Checks the sum, and that ``x``'s gradient equals
the one the same module computes locally.

    shardwise run --nproc 2 examples/rpc.py
"""

import torch
from torch import nn


class MyModule(nn.Module):
    """A linear layer whose weights are the same wherever it is built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def main() -> None:
    # block: rpc
    import os

    import torch

    import shardwise.rpc as rpc
    from shardwise.rpc import autograd as dist_autograd

    rank = int(os.environ["RANK"])                         # set by torchrun or shardwise run
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)  # env://, or tcp://host:port
    if rank == 0:
        x = torch.ones(2, 4, requires_grad=True)
        y = rpc.rpc_sync("worker1", torch.add, args=(x, 1))
        ref = rpc.remote("worker1", MyModule)              # an RRef; ref.rpc_sync().forward(x)
        with dist_autograd.context() as cid:
            loss = ref.rpc_sync().forward(x).sum()
            dist_autograd.backward(cid, [loss])
            grad = dist_autograd.get_gradients(cid)[x]     # x's gradient, through worker1
    rpc.shutdown()                                         # waits for every worker's calls
    # block: end
    if rank == 0:
        check(x, y, loss, grad)


def check(x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> None:
    local_x = x.detach().clone().requires_grad_()
    local_loss = MyModule()(local_x).sum()
    local_loss.backward()
    if not torch.equal(y, x.detach() + 1):
        raise SystemExit(f"rpc_sync(torch.add) gave {y}")
    if not (torch.allclose(loss, local_loss) and torch.allclose(grad, local_x.grad)):
        raise SystemExit(f"remote loss {loss.item()} / grad {grad} differ from local "
                         f"{local_loss.item()} / {local_x.grad}")
    print(f"ok: remote sum and forward as computed locally (loss {loss.item():.4f}); x's "
          f"gradient came back through distributed autograd")


if __name__ == "__main__":
    main()
