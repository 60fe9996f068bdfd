"""Dry runs of ZeRO-1/2 with the element partition (``--zero-partition elements``): each rank
holds its 1/N of the optimizer state (and, ZeRO-2, of the gradients) whatever the parameters'
shapes, so rank 0's model state equals the formula within 1% where the whole-parameter
partition does not; the step all-gathers the parameters once."""

from __future__ import annotations

import json

import pytest

from shardwise.cli.main import main
from shardwise.cli.plan import tp_units
from shardwise.memory.estimate import estimate_state_bytes
from shardwise.sim.fake_group import SimulationError
from shardwise.sim.models import demo_gpt
from shardwise.sim.step import DryRun, simulate_step
from tests.sim.configs import DEMO, TINY

# a GPT-2-shaped 7.5B model: GPT-2's vocabulary and context, d = 2048, 145 layers. Its
# embedding and head (103M elements each) are larger than a rank's share at 1,024 ranks (7.3M),
# so there the whole-parameter partition gives rank 0 many times 1/N of the optimizer state
GPT2_7_5B = ["--n-layer", "145", "--d-model", "2048", "--n-head", "16", "--vocab-size",
             "50257", "--seq-len", "1024"]


def _sizes():
    return [p.numel for u in tp_units(demo_gpt(DEMO)) for p in u]


def _formula(strategy, world):
    sizes = _sizes()
    units = [[p.numel for p in u] for u in tp_units(demo_gpt(DEMO))]
    return estimate_state_bytes(sizes, strategy, world, precision="fp32", units=units)


@pytest.mark.parametrize("strategy, world", [
    ("zero1", 64), ("zero1", 1024), ("zero2", 64),
    pytest.param("zero2", 1024, marks=pytest.mark.slow)])  # its ~1,000 reduces cost seconds
def test_rank_0_holds_the_formula_s_share_exactly_up_to_one_element(strategy, world):
    got = simulate_step(lambda: demo_gpt(DEMO), DryRun(strategy, world,
                                                       zero_partition="elements")).state
    want = _formula(strategy, world)
    sizes = _sizes()
    chunk = -(-sum(sizes) // world)
    assert got.params == want.params  # every rank holds every parameter
    # AdamW's two fp32 moments for rank 0's chunk, and a 4-byte step per piece (at most the
    # parameters its chunk touches, one at 1,024 ranks)
    pieces = (got.optimizer - 8 * chunk) // 4
    assert 1 <= pieces <= len(sizes) and got.optimizer == 8 * chunk + 4 * pieces
    assert got.grads == (want.grads if strategy == "zero1" else 4 * chunk)
    assert abs(got.total - want.total) <= 0.01 * want.total


def test_the_whole_parameter_partition_is_what_misses_at_1024_ranks():
    """The contrast: at 1,024 ranks a rank's share (15K elements) is far below the largest
    parameter (1M), so whole parameters put several times the share on rank 0."""
    world = 1024
    share = 8 * sum(_sizes()) / world
    whole = simulate_step(lambda: demo_gpt(DEMO), DryRun("zero1", world)).state
    elements = simulate_step(lambda: demo_gpt(DEMO),
                             DryRun("zero1", world, zero_partition="elements")).state
    assert whole.optimizer > 10 * share
    assert elements.optimizer <= 1.01 * share + 4 * len(_sizes())


@pytest.mark.parametrize("strategy", ("zero1", "zero2"))
def test_the_step_all_gathers_the_parameters_once(strategy):
    world = 64
    result = simulate_step(lambda: demo_gpt(DEMO), DryRun(strategy, world,
                                                          zero_partition="elements"))
    total = 4 * sum(_sizes())
    padded = 4 * world * -(-sum(_sizes()) // world)
    assert "broadcast" not in result.sent_bytes
    assert abs(result.sent_bytes["all_gather"] - (world - 1) / world * padded) <= 0.01 * total


@pytest.mark.parametrize("strategy", ["zero1", pytest.param("zero2", marks=pytest.mark.slow)])
def test_the_dry_run_s_work_grows_with_the_world_size_only_where_zero2_reduces(strategy):
    """ZeRO-1's step (its pieces, the all-gather) costs the same at 8,192 ranks as at 64.
    ZeRO-2 reduces each bucket to every rank whose range it meets (one ``reduce`` per owner
    off NCCL and shared memory, [Note: stage 2 buckets]); under the element partition a
    parameter meets up to ``numel / chunk + 1`` ranges, so there are at most one reduce per
    parameter and rank boundary: parameters + ranks, not parameters x ranks."""
    def run(world):
        return simulate_step(lambda: demo_gpt(TINY),
                             DryRun(strategy, world, zero_partition="elements"))

    small, large = run(64), run(8192)
    params = len(list(demo_gpt(TINY).parameters()))
    if strategy == "zero1":
        assert small.operators > 0 and large.operators <= 1.1 * small.operators, (
            small.operators, large.operators)
        assert large.collectives == small.collectives
    else:
        assert large.collectives <= small.collectives + 2 * (8192 + params)


def test_an_unknown_partition_is_a_one_line_error(capsys):
    with pytest.raises(SimulationError, match="unknown ZeRO partition 'element'"):
        DryRun("zero1", 8, zero_partition="element")
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--simulate", "--nproc", "8", "--zero-partition", "element"])
    assert exc.value.code == 2
    assert "--zero-partition" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("world", (64, 1024))
@pytest.mark.parametrize("strategy", ("zero1", "zero2"))
def test_the_7_5b_gpt2_shape_holds_the_formula_within_1_percent(strategy, world, capsys):
    """docs/scale.md's ZeRO rows: `shardwise plan --simulate --zero-partition elements` of the
    7.5B GPT-2 shape, mixed precision, rank 0's model state within 1% of the plan's formula."""
    assert main(["plan", "--simulate", "--json", *GPT2_7_5B, "--nproc", str(world),
                 "--precision", "mixed", "--strategy", strategy,
                 "--zero-partition", "elements"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert abs(record["parameters"] - 7.5e9) <= 0.01 * 7.5e9
    row = next(r for r in record["rows"] if r["strategy"] == strategy)
    got, want = row["simulated"]["model_state"], row["model_state"]
    assert abs(got - want) <= 0.01 * want, (got, want)
    assert abs(row["simulated"]["optimizer"] - 12 * record["parameters"] / world) <= (
        0.01 * 12 * record["parameters"] / world)
