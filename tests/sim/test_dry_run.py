"""Dry runs on the fake process group (shardwise.sim) against the planner's formulas.

At 64 and 1,024 ranks, one process playing rank 0, the simulated bytes a rank holds (the
library's byte accounting of its fake tensors after one step) equal the formulas of
shardwise/memory/estimate.py and layouts.py within 1% for DDP, FSDP and HSDP. ZeRO-1 and
ZeRO-2 shard whole parameters (no slices), so the rank's optimizer state is the state of the
parameters it owns: the tests check the replicated parts against the formula and the sharded
part against the greedy bound ``P / N + largest parameter`` of [Note: ZeRO partition].
The communication of one step equals the logical patterns (comm_patterns.py) computed here
from the parameter sizes.
"""

from __future__ import annotations

import pytest

from shardwise.cli.plan import tp_units
from shardwise.memory.estimate import estimate_state_bytes
from shardwise.memory.hf_config import load_hf_config
from shardwise.memory.layouts import MeshLayout, estimate_mesh_state_bytes
from shardwise.sim.fake_group import SimulationError, fake_world
from shardwise.sim.models import demo_gpt, hf_model
from shardwise.sim.step import DryRun, simulate_step
from tests.sim.configs import DEMO, TINY, llama_file


def _model(kind, tmp_path):
    if kind == "demo":
        return (lambda: demo_gpt(DEMO)), tp_units(demo_gpt(DEMO))
    path = llama_file(tmp_path)
    return (lambda: hf_model(path)), load_hf_config(path).units


def _close(simulated: int, expected: int, tol: float = 0.01) -> bool:
    return abs(simulated - expected) <= tol * expected


def _check_formula(kind, world, strategy, tmp_path):
    build, units = _model(kind, tmp_path)
    sizes = [p.numel for u in units for p in u]
    replicas = 4 if strategy == "hsdp" else 1
    got = simulate_step(build, DryRun(strategy, world, replicas=replicas)).state
    if strategy == "hsdp":
        want = estimate_mesh_state_bytes(units, MeshLayout(world, replicas=replicas),
                                         precision="fp32")
    else:
        want = estimate_state_bytes(sizes, strategy, world, precision="fp32",
                                    units=[[p.numel for p in u] for u in units])
    if strategy in ("ddp", "fsdp", "hsdp"):
        for part in ("params", "grads", "optimizer"):
            assert _close(getattr(got, part), getattr(want, part)), (part, got, want)
        return
    bound = (sum(sizes) / world + max(sizes)) * 8 + 4 * len(sizes)  # AdamW: 8 B + step
    assert got.params == want.params  # whole parameters on every rank
    assert got.grads == want.grads if strategy == "zero1" else got.grads <= bound / 2
    assert 0 < got.optimizer <= bound


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_simulated_state_equals_the_formula_at_64_ranks(strategy, tmp_path):
    _check_formula("demo", 64, strategy, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["demo", "llama"])
@pytest.mark.parametrize("world", [64, 1024])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "hsdp"])
def test_simulated_state_of_every_strategy_equals_the_formula(kind, world, strategy, tmp_path):
    _check_formula(kind, world, strategy, tmp_path)


def _param_bytes(units) -> list[int]:
    return [sum(p.numel for p in u) * 4 for u in units]


def test_fsdp_sends_the_gather_and_reduce_scatter_pattern_at_1024_ranks(tmp_path):
    """Each block is gathered in forward and again in backward, except the last block and the
    root unit, which stay gathered from forward into backward (gathered once); every unit's
    gradient is reduce-scattered once. A rank sends (n - 1) / n of each."""
    world = 1024
    build, units = _model("demo", tmp_path)
    blocks, root = _param_bytes(units[:-1]), _param_bytes(units[-1:])[0]
    r = simulate_step(build, DryRun("fsdp", world))
    share = (world - 1) / world
    gathers = share * (2 * sum(blocks[:-1]) + blocks[-1] + root)
    assert _close(r.sent_bytes["all_gather"], gathers)
    assert _close(r.sent_bytes["reduce_scatter"], share * (sum(blocks) + root))
    # and the end of backward's agreement on unused parameters, a 4-byte flag per parameter
    # ([Note: gradients of unused parameters], fsdp/reduction.py): next to nothing
    assert 0 < r.sent_bytes["all_reduce"] < 1e-3 * r.sent_bytes["reduce_scatter"]
    assert set(r.sent_bytes) == {"all_gather", "reduce_scatter", "all_reduce"}


@pytest.mark.slow
def test_ddp_and_hsdp_communication_patterns_at_1024_ranks(tmp_path):
    """DDP: one all-reduce of every gradient, 2 (n - 1) / n of the gradient bytes per rank.
    HSDP (4 replicas x 256): the in-group gathers and reduce-scatter of FSDP over 256 ranks,
    plus the all-reduce of this rank's gradient shard across the 4 replicas."""
    world, replicas = 1024, 4
    build, units = _model("demo", tmp_path)
    total = sum(_param_bytes(units))
    ddp = simulate_step(build, DryRun("ddp", world))
    assert set(ddp.sent_bytes) == {"all_reduce"}
    assert _close(ddp.sent_bytes["all_reduce"], 2 * (world - 1) / world * total)
    hsdp = simulate_step(build, DryRun("hsdp", world, replicas=replicas))
    shard = world // replicas
    assert _close(hsdp.sent_bytes["reduce_scatter"], (shard - 1) / shard * total)
    assert _close(hsdp.sent_bytes["all_reduce"],
                  2 * (replicas - 1) / replicas * total / shard)


def test_bad_mesh_and_rank_are_one_line_errors():
    with pytest.raises(SimulationError, match="cannot factor the world size: 1000 ranks"):
        DryRun("hsdp", 1000, replicas=3)
    with pytest.raises(SimulationError, match="--rank 64 is outside a world of 64"), \
            fake_world(64, 64):
        pass
    with pytest.raises(SimulationError, match="unknown strategy 'zero3'"):
        DryRun("zero3", 8)


def test_the_fake_world_is_rank_r_of_n():
    import torch.distributed as dist

    with fake_world(8192, 4321) as world:
        assert (dist.get_rank(world), dist.get_world_size(world)) == (4321, 8192)
    assert not dist.is_initialized()


def test_a_meta_model_from_a_config_has_the_planner_s_parameter_count(tmp_path):
    path = llama_file(tmp_path)
    model = hf_model(path)
    assert sum(p.numel() for p in model.parameters()) == load_hf_config(path).n_params
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("strategy", ["fsdp", *(pytest.param(s, marks=pytest.mark.slow)
                                                 for s in ("ddp", "zero1", "zero2", "hsdp"))])
def test_the_dry_run_s_work_does_not_grow_with_the_world_size(strategy):
    """The operators a dry run dispatches on fake tensors (wrapping and two steps) at 8,192
    ranks are at most those at 64 ranks, give or take 10% (padding adds a few copies): no part of
    the library's code makes a tensor, or issues a collective, per rank of the group."""
    def run(world):
        return simulate_step(lambda: demo_gpt(TINY), DryRun(strategy, world, replicas=8 if
                                                             strategy == "hsdp" else 1))

    small, large = run(64), run(8192)
    assert small.operators > 0 and large.operators <= 1.1 * small.operators, (
        small.operators, large.operators)
    assert large.collectives == small.collectives
