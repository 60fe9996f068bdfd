"""An RPC program split over two files of its own (issue 26.4): this script and
``rpc_program_parts.py`` beside it, in the shape of pytorch/examples' distributed RNN. The
trainer builds an ``RNNModel`` whose embedding and decoder live on the parameter server
(``rpc.remote`` of classes of the second file), runs their ``forward`` through functions of that
file (``rpc_sync`` of ``_call_method``), asks the server for batches (``rpc_sync`` of a function
there), calls a method of an RRef's value (``rref.rpc_sync().weight_norm()``) and trains with a
DistributedOptimizer. shardwise runs it as written, with no ``allowed_modules``.

Run as ``python -m tests.compat.test_rpc_program_files IMPL OUT_DIR`` (rank 0: trainer,
rank 1: parameter server).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from tests.compat import rpc_program_parts as parts
from tests.rpc.launch import run_both, save

# the program's one line that differs between the two runs: the imports
IMPL = sys.argv[1] if __name__ == "__main__" else None  # pytest imports neither
if IMPL == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
elif IMPL == "shardwise":
    import shardwise.rpc as rpc
    from shardwise.rpc import DistributedOptimizer
    from shardwise.rpc import autograd as dist_autograd

NTOKEN, NINP, NHID, NLAYERS, STEPS, SEQ, BATCH = 10, 4, 6, 2, 3, 5, 2


def run_trainer(ps: str) -> dict:
    model = parts.RNNModel(ps, NTOKEN, NINP, NHID, NLAYERS)
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.2)
    norms = [model.emb_table_rref.rpc_sync().weight_norm()]
    hidden = (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))
    losses = []
    for _ in range(STEPS):  # one batch, again and again: the loss must go down
        data, target = rpc.rpc_sync(ps, parts.make_batch, args=(0, NTOKEN, SEQ, BATCH))
        hidden = (hidden[0].detach(), hidden[1].detach())
        with dist_autograd.context() as context_id:
            output, hidden = model(data, hidden)
            loss = nn.functional.cross_entropy(output.view(-1, NTOKEN), target.view(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.detach())
    norms.append(model.emb_table_rref.rpc_sync().weight_norm())
    return {"losses": torch.stack(losses), "norms": torch.stack(norms),
            "embedding": model.emb_table_rref.to_here().encoder.weight.detach(),
            "rnn": [p.detach() for p in model.rnn.parameters()]}


def main(impl: str, out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # warm torch.optim's imports
    if rank == 1:
        rpc.init_rpc("ps", rank=rank, world_size=world)
        rpc.shutdown()  # serves the trainer until it has shut down
        save(out_dir, impl, rank, {})
        return
    rpc.init_rpc("trainer", rank=rank, world_size=world)
    results = run_trainer("ps")
    rpc.shutdown()
    save(out_dir, impl, rank, results)


def test_program_split_over_two_files_runs_as_with_torch(tmp_path):
    from tests.harness import assert_rel_close

    runs = run_both("tests.compat.test_rpc_program_files", 2, tmp_path)
    ours, theirs = runs["shardwise"][0], runs["torch"][0]
    for key in ("losses", "norms", "embedding"):
        assert_rel_close(ours[key], theirs[key], 1e-6, key)
    for i, (a, b) in enumerate(zip(ours["rnn"], theirs["rnn"])):
        assert_rel_close(a, b, 1e-6, f"rnn parameter {i}")
    assert theirs["losses"][-1] < theirs["losses"][0]  # it trained
    assert not torch.equal(theirs["norms"][0], theirs["norms"][1])  # the server's table moved


if __name__ == "__main__":
    main(*sys.argv[1:])
