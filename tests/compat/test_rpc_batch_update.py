"""Batch-updating parameter server with ``@rpc.functions.async_execution``, in the style of
pytorch/examples' batch RPC examples: every trainer sends its gradients and gets back a future
that completes when the batch is full and the server has stepped; the reply is that future's
``.then(...)`` (a ``torch._C.Future``), the updated weights.

Run as ``python -m tests.compat.test_rpc_batch_update IMPL OUT_DIR`` (rank 0: the server,
which also drives the trainers; ranks 1-2: trainers).
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from torch import nn

from tests.rpc.launch import run_both, save

# the program's one line that differs between the two runs: the import
IMPL = sys.argv[1] if __name__ == "__main__" else "torch"  # (pytest: for the decorator)
if IMPL == "torch":
    import torch.distributed.rpc as rpc
else:
    import shardwise.rpc as rpc

STEPS, TRAINERS = 3, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 2)


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size: int = TRAINERS):
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        # reply with a copy of the updated weights once the batch is done
        return fut.then(lambda f: [p.detach().clone() for p in f.wait().parameters()])


class Trainer:
    def __init__(self, ps_rref, rank: int):
        self.ps_rref = ps_rref
        self.generator = torch.Generator().manual_seed(rank)

    def train(self) -> dict:
        m = self.ps_rref.rpc_sync().get_model()
        losses = []
        for _ in range(STEPS):
            x = torch.randn(4, 5, generator=self.generator)
            y = torch.randn(4, 2, generator=self.generator)
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            losses.append(loss.detach())
            weights = rpc.rpc_sync(
                self.ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.parameters()]))
            with torch.no_grad():
                for p, w in zip(m.parameters(), weights):
                    p.copy_(w)
                    p.grad = None
        return {"losses": torch.stack(losses), "weights": [p.detach() for p in m.parameters()]}


def run_trainer(ps_rref, rank: int) -> dict:
    return Trainer(ps_rref, rank).train()


def run_ps(trainers: list[str]) -> list[dict]:
    ps_rref = rpc.RRef(BatchUpdateParameterServer())
    futs = [rpc.rpc_async(t, run_trainer, args=(ps_rref, i + 1)) for i, t in enumerate(trainers)]
    return torch.futures.wait_all(futs)


def main(impl: str, out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # warm torch.optim's imports
    if rank == 0:
        rpc.init_rpc("ps", rank=rank, world_size=world)
        results = run_ps([f"trainer{r}" for r in range(1, world)])
        rpc.shutdown()
        for r, res in enumerate(results, start=1):
            save(out_dir, impl, r, res)
        save(out_dir, impl, 0, {})
    else:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world)
        rpc.shutdown()


def test_batch_update_with_async_execution_and_then_matches_torch(tmp_path):
    from tests.harness import assert_rel_close

    runs = run_both("tests.compat.test_rpc_batch_update", 1 + TRAINERS, tmp_path)
    for rank in range(1, 1 + TRAINERS):
        ours, theirs = runs["shardwise"][rank], runs["torch"][rank]
        assert_rel_close(ours["losses"], theirs["losses"], 1e-6, f"trainer {rank} losses")
        for i, (a, b) in enumerate(zip(ours["weights"], theirs["weights"])):
            assert_rel_close(a, b, 1e-6, f"trainer {rank} parameter {i}")
    # both trainers end with the server's same weights
    for a, b in zip(runs["shardwise"][1]["weights"], runs["shardwise"][2]["weights"]):
        assert torch.equal(a, b)


if __name__ == "__main__":
    main(*sys.argv[1:])
