"""DDP and RPC on torchrun's one MASTER_PORT: ``init_process_group`` then ``init_rpc``, both
rendezvousing through the store torchrun's agent hosts there, as the DDP + RPC tutorial does.
Each rank trains a DDP model on batches it fetches by RPC from the other rank.

Run under ``torchrun --nproc-per-node 2 -m tests.compat.test_rpc_ddp_share_port IMPL OUT_DIR``;
the test runs it with torch's DDP and RPC, and with ours.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.rpc.launch import run_both, save

# the program's one line that differs between the two runs: the imports
IMPL = sys.argv[1] if __name__ == "__main__" else None  # pytest imports neither
if IMPL == "torch":
    import torch.distributed.rpc as rpc
    from torch.nn.parallel import DistributedDataParallel as DDP
elif IMPL == "shardwise":
    import shardwise.rpc as rpc
    from shardwise import DistributedDataParallel as DDP

STEPS = 4


def get_batch(rank: int, step: int):
    """Served by the other rank: the batch of ``rank`` at ``step``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)


def main(impl: str, out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # env:// on torchrun's MASTER_ADDR / MASTER_PORT
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)  # the same port
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    peer = f"worker{(rank + 1) % world}"
    losses = []
    for step in range(STEPS):
        x, y = rpc.rpc_sync(peer, get_batch, args=(rank, step))
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    rpc.shutdown()
    dist.destroy_process_group()
    save(out_dir, impl, rank, {"losses": torch.stack(losses),
                               "weights": [p.detach() for p in model.parameters()]})


def test_ddp_and_rpc_share_torchrun_port_and_train_as_torch(tmp_path):
    from tests.harness import assert_rel_close

    runs = run_both("tests.compat.test_rpc_ddp_share_port", 2, tmp_path, torchrun=True)
    for rank in range(2):
        ours, theirs = runs["shardwise"][rank], runs["torch"][rank]
        # gradients are averaged by all-reduce: summation order may differ in the last bit
        assert_rel_close(ours["losses"], theirs["losses"], 1e-5, f"rank {rank} losses")
        for i, (a, b) in enumerate(zip(ours["weights"], theirs["weights"])):
            assert_rel_close(a, b, 1e-5, f"rank {rank} parameter {i}")
    for a, b in zip(runs["shardwise"][0]["weights"], runs["shardwise"][1]["weights"]):
        assert torch.equal(a, b)  # DDP kept the replicas equal


if __name__ == "__main__":
    main(*sys.argv[1:])
