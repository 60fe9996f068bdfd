"""Bytes per step that cross the node boundary, world size 4 as 2 nodes x 2 ranks, the demo GPT.

Counted by each collective's logical pattern (``CommCounter``: what each rank's data must
reach), per rank and training step, as a multiple of the model's bytes M. The patterns give:
FULL_SHARD 1.5 M (two all-gathers of a quarter each reaching the 2 ranks of the other node, and
a reduce-scatter whose 2 cross-node parts are a quarter each), HSDP with shards inside a node
0.5 M (only the all-reduce of each rank's half across the 2 replicas), DDP 1.0 M (an all-reduce
counted as reduce-scatter plus all-gather). The root unit stays gathered from forward to
backward, and so does the unit that runs last in forward (backward starts with it, so it would
be gathered again at once): FULL_SHARD gathers those two once per step, and its figure is below
1.5 M by half their share of the model. Counted on the pattern's own schedule instead (both
units resharded by hand after forward, ``FSDPModule.reshard()``, so that backward gathers every
unit again), FULL_SHARD sends the pattern's 1.5 M, and HSDP (whose gathers never leave a node,
whatever the schedule) a third of it. Counts are exact; nothing is timed.
"""

from __future__ import annotations

import pytest
import torch

from shardwise import DistributedDataParallel, fully_shard
from shardwise.distributed import CommCounter, init_device_mesh
from shardwise.dp.shm_reduce import DISABLE_VAR
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.fsdp.gathering import gathering_units
from tests.harness import run_on_ranks

CFG = GPTConfig()  # the demo GPT's default shape


def _step(model, x, reshard_all: bool = False):
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    if reshard_all:  # the pattern's schedule: no unit stays gathered from forward to backward
        model.reshard()
        model.blocks[-1].reshard()
    loss.backward()


def _cross_node_per_step(ctx, strategy: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    last = f"blocks.{CFG.n_layer - 1}."
    kept_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if not n.startswith("blocks.") or n.startswith(last))
    if strategy == "ddp":
        # two simulated nodes on one host: DDP's same-host shared-memory reduction would move
        # nothing through the group, so the gloo path shows the pattern that crosses real nodes
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(DISABLE_VAR, "1")
            model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (2, 2) if strategy.startswith("hsdp") else (4,))
        with gathering_units():  # as for DDP: host-shared parameters would gather nothing
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    x = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len + 1))
    reshard_all = strategy.endswith("_resharded")
    _step(model, x, reshard_all)  # the first step records the forward order
    with CommCounter(local_world_size=2) as comm:
        _step(model, x, reshard_all)
    return comm.get().cross_node_bytes / model_bytes, kept_bytes / model_bytes, comm.table()


def test_bytes_crossing_nodes_per_step_follow_the_logical_patterns():
    ratios = {}
    for strategy in ("full_shard", "full_shard_resharded", "hsdp", "hsdp_resharded", "ddp"):
        results = run_on_ranks(4, _cross_node_per_step, strategy)
        ratios[strategy] = [r[0] for r in results]
        kept_share = results[0][1]
        print(f"\n{strategy}: cross-node bytes per rank and step / model bytes = "
              f"{[round(r, 4) for r in ratios[strategy]]}\n{results[0][2]}")
    expected = {"full_shard": 1.5 - 0.5 * kept_share, "full_shard_resharded": 1.5, "hsdp": 0.5,
                "hsdp_resharded": 0.5, "ddp": 1.0}
    for strategy, values in ratios.items():
        for value in values:  # every rank; padding makes a rank send slightly more
            assert abs(value - expected[strategy]) <= 0.05 * expected[strategy], (strategy,
                                                                                 value)
    # HSDP against FULL_SHARD on the pattern's schedule (every unit gathered twice: 1.5 M), both
    # measured. Against the default schedule (1.5 M less half the two kept units' share: 1.34 M
    # on this 4-block model) it is 0.37x: keeping units gathered saves FULL_SHARD cross-node
    # gathers, and HSDP has none to save (see docs/mesh.md)
    assert max(ratios["hsdp"]) <= 0.35 * min(ratios["full_shard_resharded"])
    assert max(ratios["hsdp"]) <= 0.38 * min(ratios["full_shard"])
