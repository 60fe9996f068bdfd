"""An RPC program split over two files of its own (issue 26.4): this script and
``rpc_program_parts.py`` beside it, in the shape of pytorch/examples' distributed RNN. The
trainer builds an ``RNNModel`` whose embedding and decoder live on the parameter server
(``rpc.remote`` of classes of the second file), runs their ``forward`` through functions of that
file (``rpc_sync`` of ``_call_method``), asks the server for batches as numpy arrays
(``rpc_sync`` of a function there), calls a method of an RRef's value
(``rref.rpc_sync().weight_norm()``), trains with a DistributedOptimizer, and gets a model of a
library module (``visionlike``, a torchvision-style ResNet placed outside the program's
directories) back through an RRef method. shardwise runs it with no ``allowed_modules``, once
the second file registers the two private helpers that peers call (``_call_method``,
``_parameter_rrefs``): a module of the program serves no private name unregistered.

Run as ``python -m tests.compat.test_rpc_program_files IMPL OUT_DIR`` (rank 0: trainer,
rank 1: parameter server).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

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
VISION_INPUT = torch.linspace(-1, 1, 2 * 36).reshape(2, 1, 6, 6)


def run_trainer(ps: str) -> dict:
    model = parts.RNNModel(ps, NTOKEN, NINP, NHID, NLAYERS)
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.2)
    norms = [model.emb_table_rref.rpc_sync().weight_norm()]
    hidden = (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))
    losses = []
    for _ in range(STEPS):  # one batch, again and again: the loss must go down
        data, target = rpc.rpc_sync(ps, parts.make_batch_np, args=(0, NTOKEN, SEQ, BATCH))
        data, target = torch.from_numpy(data), torch.from_numpy(target)
        hidden = (hidden[0].detach(), hidden[1].detach())
        with dist_autograd.context() as context_id:
            output, hidden = model(data, hidden)
            loss = nn.functional.cross_entropy(output.view(-1, NTOKEN), target.view(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.detach())
    norms.append(model.emb_table_rref.rpc_sync().weight_norm())
    import visionlike  # the trainer uses the library too, as a torchvision user would

    net = rpc.remote(ps, parts.ModelStore, args=(5,)).rpc_sync().get_model()
    assert type(net) is visionlike.TinyResNet, type(net)
    return {"vision": net(VISION_INPUT).detach(), "vision_state": net.state_dict(),
            "losses": torch.stack(losses), "norms": torch.stack(norms),
            "embedding": model.emb_table_rref.to_here().encoder.weight.detach(),
            "rnn": [p.detach() for p in model.rnn.parameters()]}


def main(impl: str, out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sys.path.append(str(Path(out_dir) / "lib"))  # where the library `visionlike` is installed
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

    lib = tmp_path / "lib"  # outside the script's directory and the working directory
    lib.mkdir()
    shutil.copy(Path(__file__).parents[1] / "rpc" / "netlike.py", lib / "visionlike.py")
    runs = run_both("tests.compat.test_rpc_program_files", 2, tmp_path)
    ours, theirs = runs["shardwise"][0], runs["torch"][0]
    from tests.rpc import netlike

    reference = netlike.make(5)
    assert_rel_close(ours["vision"], theirs["vision"], 1e-6, "library model's output")
    assert_rel_close(ours["vision"], reference(VISION_INPUT).detach(), 1e-6, "vs local model")
    assert ours["vision_state"].keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(ours["vision_state"][key], value), key
    for key in ("losses", "norms", "embedding"):
        assert_rel_close(ours[key], theirs[key], 1e-6, key)
    for i, (a, b) in enumerate(zip(ours["rnn"], theirs["rnn"])):
        assert_rel_close(a, b, 1e-6, f"rnn parameter {i}")
    assert theirs["losses"][-1] < theirs["losses"][0]  # it trained
    assert not torch.equal(theirs["norms"][0], theirs["norms"][1])  # the server's table moved


if __name__ == "__main__":
    main(*sys.argv[1:])
