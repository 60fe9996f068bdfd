"""torch's distributed checkpoint recipe (the DCP tutorial's ``AppState``), written in its
documented idioms and run twice at world size 2 under ``fully_shard``: once with
``torch.distributed.checkpoint`` and torch's FSDP2, once with the imports swapped to
``shardwise.checkpoint`` and ``shardwise.fully_shard`` (issue 26 point 3).

The recipe: an ``AppState(Stateful)`` holding model and optimizer, whose ``state_dict`` /
``load_state_dict`` call ``get_state_dict`` / ``set_state_dict``; ``dcp.save({"app":
AppState(...)}, checkpoint_id=...)``, ``dcp.load``, ``dcp.async_save``; then
``format_utils.dcp_to_torch_save`` and the one file loaded into a plain model. Both give the
same numbers (1e-6 relative), and a load continues exactly like the run that saved.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from tests.compat.models import Transformer
from tests.compat.models import batch as _batch
from tests.harness import assert_rel_close, run_on_ranks

RTOL = 1e-6


def _api(impl: str):
    """``(dcp, dcp_to_torch_save, torch_save_to_dcp, fully_shard)`` of torch or shardwise."""
    if impl == "torch":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import (
            dcp_to_torch_save,
            torch_save_to_dcp,
        )
        from torch.distributed.fsdp import fully_shard
    else:
        import shardwise.checkpoint as dcp
        from shardwise import fully_shard
        from shardwise.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    return dcp, dcp_to_torch_save, torch_save_to_dcp, fully_shard


class AppState(Stateful):
    """As in torch's "Getting Started with Distributed Checkpoint" recipe."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _sharded(fully_shard):
    torch.manual_seed(0)
    model = Transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model, opt, ctx, first, n):
    losses = []
    for step in range(first, first + n):
        x, y, _, _ = _batch(step, ctx.rank, ctx.world_size)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / ctx.world_size)
    return losses


def _full(model):
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _recipe(ctx, impl, root):
    dcp, dcp_to_torch_save, torch_save_to_dcp, fully_shard = _api(impl)
    root = f"{root}/{impl}"
    model, optimizer = _sharded(fully_shard)
    first = _steps(model, optimizer, ctx, 0, 2)
    state_dict = {"app": AppState(model, optimizer)}
    dcp.save(state_dict, checkpoint_id=f"{root}/step2")
    after_save = _steps(model, optimizer, ctx, 2, 2)

    # a fresh model and optimizer, loaded through the Stateful object, continue exactly
    fresh, fresh_opt = _sharded(fully_shard)
    state_dict = {"app": AppState(fresh, fresh_opt)}
    dcp.load(state_dict, checkpoint_id=f"{root}/step2")
    after_load = _steps(fresh, fresh_opt, ctx, 2, 2)
    assert after_load == after_save, (after_load, after_save)

    future = dcp.async_save({"app": AppState(fresh, fresh_opt)}, checkpoint_id=f"{root}/step4")
    future.result()
    trained = _full(fresh)
    other, other_opt = _sharded(fully_shard)
    dcp.load({"app": AppState(other, other_opt)}, checkpoint_id=f"{root}/step4")
    loaded = _full(other)
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key

    out = None
    if ctx.rank == 0:  # a single-process user: one torch.save file, a plain model
        dcp_to_torch_save(f"{root}/step4", f"{root}/step4.pt")
        whole = torch.load(f"{root}/step4.pt", weights_only=True)
        plain = Transformer()
        plain.load_state_dict(whole["app"]["model"])
        _, _, x, y = _batch(9, 0, ctx.world_size)
        with torch.no_grad():
            plain_loss = _loss(plain, x, y).item()
        # and back: the one file as a checkpoint that loads like the original
        torch_save_to_dcp(f"{root}/step4.pt", f"{root}/step4_again")
        again = Transformer()
        state = {"app": {"model": again.state_dict()}}
        dcp.load(state, checkpoint_id=f"{root}/step4_again", no_dist=True)
        again.load_state_dict(state["app"]["model"])
        out = {"plain": {k: v.clone() for k, v in plain.state_dict().items()},
               "again": {k: v.clone() for k, v in again.state_dict().items()},
               "plain_loss": plain_loss,
               "exp_avg": whole["app"]["optim"]["state"]["layers.0.w1.weight"]["exp_avg"]}
    dist.barrier()
    return first, after_save, trained, out


def test_stateful_recipe_and_format_utils_match_torch(tmp_path):
    ours = run_on_ranks(2, _recipe, "shardwise", str(tmp_path))
    theirs = run_on_ranks(2, _recipe, "torch", str(tmp_path))
    for rank in range(2):
        (first, after, trained, _), (t_first, t_after, t_trained, _) = ours[rank], theirs[rank]
        for a, b in zip(first + after, t_first + t_after, strict=True):
            assert abs(a - b) <= RTOL * abs(b), (first + after, t_first + t_after)
        for key, value in t_trained.items():
            assert_rel_close(trained[key], value, RTOL, f"rank {rank} {key}")
    mine, torch_ = ours[0][3], theirs[0][3]
    assert abs(mine["plain_loss"] - torch_["plain_loss"]) <= RTOL * abs(torch_["plain_loss"])
    assert_rel_close(mine["exp_avg"], torch_["exp_avg"], RTOL, "exp_avg in the one file")
    for key, value in torch_["plain"].items():
        assert_rel_close(mine["plain"][key], value, RTOL, f"plain {key}")
        assert torch.equal(mine["plain"][key], ours[0][2][key]), key  # the file is the state
        assert torch.equal(mine["again"][key], mine["plain"][key]), key
