"""Sharded checkpoints with ``shardwise.checkpoint``: save, resume, async save, export, from
docs/checkpoint.md (both of its blocks).

A demo GPT sharded with ``fully_shard`` trains a few steps and is saved; a new model and
optimizer load that checkpoint and train on. Checks that the resumed run's losses equal the
uninterrupted run's exactly, that the exported safetensors file holds every weight, and that
torch's ``Stateful`` recipe and the ``torch.save`` conversions round-trip. Files go to a fresh
temporary directory.

    shardwise run --nproc 2 examples/checkpoint.py
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardwise import fully_shard
from shardwise.distributed import init
from shardwise.models import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same sharded GPT and AdamW on every call (seeded)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=gen)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_and_resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    # block: checkpoint
    from shardwise import checkpoint as ckpt

    model_sd, optim_sd = ckpt.get_state_dict(model, optimizer)
    ckpt.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id="ckpt/step_200")

    # later, any strategy, any world size: a new model and optimizer take the saved state
    model, optimizer = build()
    model_sd, optim_sd = ckpt.get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    ckpt.load(state, checkpoint_id="ckpt/step_200")          # in place, resharding as needed
    ckpt.set_state_dict(model, optimizer, model_state_dict=state["model"],
                        optim_state_dict=state["optim"])
    step = state["step"]

    future = ckpt.async_save(state, checkpoint_id="ckpt/step_300")  # returns after a CPU copy
    future.result()                                                 # committed
    if rank == 0:
        ckpt.export_safetensors("ckpt/step_200", "model.safetensors", prefix="model.")
        ckpt.inspect("ckpt/step_200")   # every tensor's shape, dtype and chunks
    # block: end
    return model, optimizer, step


def stateful_recipe(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    # block: stateful
    from torch.distributed.checkpoint.stateful import Stateful

    import shardwise.checkpoint as dcp
    from shardwise.checkpoint import get_state_dict, set_state_dict
    from shardwise.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    class AppState(Stateful):
        def __init__(self, model, optimizer):
            self.model, self.optimizer = model, optimizer

        def state_dict(self):
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd):
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])

    dcp.save({"app": AppState(model, opt)}, checkpoint_id="ckpt/app")
    dcp.load({"app": AppState(model, opt)}, checkpoint_id="ckpt/app")
    if rank == 0:
        dcp_to_torch_save("ckpt/app", "model.pt")        # one torch.save file, nested as saved
        torch_save_to_dcp("model.pt", "ckpt/from_file")  # and back (weights_only=True)
    # block: end


def main() -> None:
    init()
    rank = dist.get_rank()
    where = [tempfile.mkdtemp(prefix="shardwise-example-") if rank == 0 else None]
    dist.broadcast_object_list(where)  # one directory for every rank (one host)
    os.chdir(where[0])
    model, optimizer = build()
    before = train(model, optimizer, range(0, 3))
    resumed, resumed_opt, step = save_and_resume(model, optimizer, 3, rank)
    straight = train(model, optimizer, range(step, 6))
    again = train(resumed, resumed_opt, range(step, 6))
    print(f"rank {rank} losses {before} then {straight}, resumed {again}")
    if again != straight:
        raise SystemExit(f"the resumed run differs: {again} != {straight}")
    stateful_recipe(resumed, resumed_opt, rank)
    dist.barrier()
    if rank == 0:
        exported = load_file("model.safetensors")
        names = {k.removeprefix("_orig_mod.") for k in GPT(CONFIG).state_dict()}
        if set(exported) != names:
            raise SystemExit(f"the export holds {sorted(exported)}, not {sorted(names)}")
        converted = torch.load("model.pt", weights_only=True)["app"]["model"]
        if set(converted) != names:
            raise SystemExit(f"model.pt holds {sorted(converted)}, not {sorted(names)}")
        shutil.rmtree(where[0])
        print(f"ok: resumed at step {step} with the uninterrupted run's losses {again}; "
              f"{len(exported)} tensors exported; the Stateful recipe round-trips")


if __name__ == "__main__":
    main()
