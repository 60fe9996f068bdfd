"""RemoteModule training with DistributedOptimizer, in the shape of the DDP + RPC tutorial
(without DDP): the master creates a RemoteModule embedding on the parameter server and hands it
to the trainer by RPC; the trainer runs it with a local layer under distributed autograd and
steps a DistributedOptimizer over ``remote_parameters()`` and its local parameters. The server
and the trainer call ``shutdown()`` right after ``init_rpc``.

Run as ``python -m tests.compat.test_rpc_remote_module IMPL OUT_DIR`` (rank 0: master,
1: parameter server, 2: trainer).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from tests.rpc.launch import run_both, save

# the program's one line that differs between the two runs: the imports
IMPL = sys.argv[1] if __name__ == "__main__" else None  # pytest imports neither
if IMPL == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
elif IMPL == "shardwise":
    import shardwise.rpc as rpc
    from shardwise.rpc import DistributedOptimizer, RemoteModule
    from shardwise.rpc import autograd as dist_autograd

NUM_EMBEDDINGS, EMBEDDING_DIM, STEPS = 12, 4, 4


def _run_trainer(remote_emb_module) -> dict:
    torch.manual_seed(1)
    fc = nn.Linear(EMBEDDING_DIM, 3)
    model_parameter_rrefs = remote_emb_module.remote_parameters()
    model_parameter_rrefs += [rpc.RRef(p) for p in fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=0.05)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        indices = torch.randint(0, NUM_EMBEDDINGS, (10,), generator=g)
        offsets = torch.tensor([0, 3, 7])
        target = torch.randint(0, 3, (3,), generator=g)
        with dist_autograd.context() as context_id:
            emb = remote_emb_module.forward(indices, offsets)
            loss = nn.functional.cross_entropy(fc(emb), target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.detach())
    # the same module again, through forward_async
    out = remote_emb_module.forward_async(torch.tensor([1, 2]), torch.tensor([0])).wait()
    return {"losses": torch.stack(losses), "fc": [p.detach() for p in fc.parameters()],
            "embedding": remote_emb_module.get_module_rref().to_here().weight.detach(),
            "async_out": out.detach()}


def main(impl: str, out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # warm torch.optim's imports
    torch.manual_seed(0)  # the server builds the embedding with its own generator
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world)
        remote_emb_module = RemoteModule("ps/cpu", nn.EmbeddingBag,
                                         args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                         kwargs={"mode": "sum"})
        results = rpc.rpc_sync("trainer", _run_trainer, args=(remote_emb_module,))
        rpc.shutdown()
        save(out_dir, impl, 0, results)
    else:
        rpc.init_rpc("ps" if rank == 1 else "trainer", rank=rank, world_size=world)
        rpc.shutdown()
        save(out_dir, impl, rank, {})


def test_remote_module_with_distributed_optimizer_trains_as_torch(tmp_path):
    from tests.harness import assert_rel_close

    runs = run_both("tests.compat.test_rpc_remote_module", 3, tmp_path)
    ours, theirs = runs["shardwise"][0], runs["torch"][0]
    assert_rel_close(ours["losses"], theirs["losses"], 1e-6, "losses")
    for i, (a, b) in enumerate(zip(ours["fc"], theirs["fc"])):
        assert_rel_close(a, b, 1e-6, f"local layer parameter {i}")
    assert_rel_close(ours["embedding"], theirs["embedding"], 1e-6, "remote embedding")
    assert_rel_close(ours["async_out"], theirs["async_out"], 1e-6, "forward_async")


if __name__ == "__main__":
    main(*sys.argv[1:])
