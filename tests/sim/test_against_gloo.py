"""The dry run at world size 4 against a real 4-rank gloo run of the same model and step.

The real run wraps the demo GPT with the same library calls on a gloo world (the test
harness's rank pool), runs two steps and counts the second with ``CommCounter``; the dry run
plays each rank on the fake group. Bytes held (parameters, gradients, optimizer state) and
bytes sent per collective kind agree within 1%. On gloo, DDP's same-host shared-memory
reduction and FSDP's host-shared parameters are turned off for the real run (a simulated world
spans hosts), and FSDP's gathers
and gradient reduce-scatters take gloo's fastest equivalents (broadcasts; point-to-point sends,
see [Note: fast collectives]) where the fake group, like NCCL, gets the collectives themselves:
the pieces add up to the logical collective's bytes ([Note: counting communication]), so the
real run's broadcasts are compared with the dry run's all-gathers and its sends with the
reduce-scatters.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from shardwise.distributed import CommCounter
from shardwise.dp.shm_reduce import DISABLE_VAR
from shardwise.fsdp.host_params import DISABLE_VAR as PARAMS_DISABLE_VAR
from shardwise.memory.accounting import state_bytes
from shardwise.models import GPT, GPTConfig
from shardwise.sim import step as sim_step
from shardwise.sim.step import DryRun, simulate_step
from tests.harness import run_on_ranks

GLOO_PIECES = {"broadcast": "all_gather", "send": "reduce_scatter"}
CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=16)


def _real(ctx, strategy: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    run = DryRun(strategy, ctx.world_size, rank=ctx.rank, replicas=2 if strategy == "hsdp"
                 else 1)
    os.environ[DISABLE_VAR] = os.environ[PARAMS_DISABLE_VAR] = "1"
    try:
        meshes = sim_step._meshes(run, dist.group.WORLD)
        wrapped = sim_step.WRAPPERS[strategy](model, run, dist.group.WORLD, meshes)
    finally:
        del os.environ[DISABLE_VAR], os.environ[PARAMS_DISABLE_VAR]
    ids = torch.zeros((1, CFG.seq_len), dtype=torch.long)
    sim_step._step(wrapped, ids)
    with CommCounter() as comm:
        sim_step._step(wrapped, ids)
    sent: dict[str, int] = {}
    for (kind, _), stats in comm.counts.items():
        if strategy in ("fsdp", "hsdp"):
            kind = GLOO_PIECES.get(kind, kind)
        sent[kind] = sent.get(kind, 0) + stats.sent_bytes
    sent.pop("recv", None)  # receiving sends nothing
    return state_bytes(wrapped.params, wrapped.optimizer), sent


@pytest.mark.parametrize("strategy", ["fsdp", *(pytest.param(s, marks=pytest.mark.slow)
                                                 for s in ("ddp", "zero1", "zero2", "hsdp"))])
def test_dry_run_holds_and_sends_what_a_real_gloo_run_does(strategy):
    real = run_on_ranks(4, _real, strategy, timeout=300)
    for rank in (0, 3):
        run = DryRun(strategy, 4, rank=rank, replicas=2 if strategy == "hsdp" else 1)
        sim = simulate_step(_meta, run)
        held, sent = real[rank]
        for part in ("params", "grads", "optimizer"):
            want, got = getattr(held, part), getattr(sim.state, part)
            assert abs(got - want) <= 0.01 * want, (rank, part, got, want)
        assert set(sim.sent_bytes) == set(sent), (rank, sim.sent_bytes, sent)
        for kind, want in sent.items():
            assert abs(sim.sent_bytes[kind] - want) <= 0.01 * want, (rank, kind, sim.sent_bytes,
                                                                      sent)


def _meta():
    from shardwise.sim.models import demo_gpt

    return demo_gpt(CFG)
