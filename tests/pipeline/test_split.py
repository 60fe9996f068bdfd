"""Splitting models into stages and the schedules' orders (pure functions, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.models import GPT, GPTConfig
from shardwise.pipeline import (
    ActivationMeter,
    balanced_cuts,
    bubble_fraction,
    gpipe_order,
    max_in_flight,
    one_f_one_b_order,
    parameter_costs,
    split_by_names,
    split_gpt,
    split_layers,
)
from shardwise.pipeline.split import cuts_from_points, gpt_layers, sequential_layers

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, seq_len=16)


def _brute_force_best(costs, stages):
    import itertools

    n, best = len(costs), float("inf")
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = [0, *inner, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:])))
    return best


@pytest.mark.parametrize("costs,stages", [([1, 5, 5, 5, 5, 1], 2), ([9, 1, 1, 1, 1, 1, 1], 3),
                                          ([3, 1, 4, 1, 5, 9, 2, 6], 4), ([2, 2], 2)])
def test_balanced_cuts_minimise_the_heaviest_stage(costs, stages):
    cuts = balanced_cuts(costs, stages)
    assert cuts[0] == 0 and cuts[-1] == len(costs) and len(cuts) == stages + 1
    assert all(a < b for a, b in zip(cuts, cuts[1:]))  # no empty stage
    heaviest = max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:]))
    assert heaviest == _brute_force_best(costs, stages)


def test_balanced_cuts_reject_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        balanced_cuts([1, 1], 3)


def test_split_points_by_name_and_alias():
    names = [n for n, _ in gpt_layers(GPT(CFG))]
    assert cuts_from_points(names, ["blocks.2"]) == [0, 3, 6]
    assert cuts_from_points(names, ["blocks.0", "ln_f"]) == [0, 1, 5, 6]
    with pytest.raises(ValueError, match="names no layer"):
        cuts_from_points(names, ["blocks.9"])
    with pytest.raises(ValueError, match="must come after"):
        cuts_from_points(names, ["blocks.2", "blocks.1"])


def test_split_gpt_composes_to_the_model():
    torch.manual_seed(0)
    gpt = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for stages in (split_gpt(gpt, 3), split_gpt(gpt, split_points=["blocks.1", "blocks.3"]),
                   split_gpt(gpt, 2, cost="time", sample=x)):
        y = x
        for s in stages:
            y = s(y)
        torch.testing.assert_close(y, gpt(x), rtol=0, atol=0)
        params = [p for s in stages for p in s.parameters()]
        assert sorted(map(id, params)) == sorted(id(p) for p in gpt.parameters())


def test_split_by_params_balances_parameter_counts():
    gpt = GPT(CFG)
    stages = split_gpt(gpt, 2)
    costs = parameter_costs(gpt_layers(gpt))
    got = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert max(got) == _brute_force_best(costs, 2)


def test_sequential_split_and_cover_check():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    stages = split_layers(sequential_layers(seq), split_points=["2"])
    assert [s.layer_names for s in stages] == [["0", "1"], ["2", "3"]]
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), seq(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"does not cover the model: no stage holds \['3.weight'"):
        split_by_names(seq, [["0", "1"], ["2"]])
    with pytest.raises(ValueError, match="no submodule named"):
        split_by_names(seq, [["0", "9"]])
    with pytest.raises(ValueError, match="stages 0 and 1 share a parameter"):
        split_by_names(seq, [["0", "2"], ["2", "3"]])


def test_tied_weights_across_stages_are_refused():
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, tie_weights=True))
    with pytest.raises(ValueError, match="share a parameter"):
        split_gpt(gpt, 2)


@pytest.mark.parametrize("stages,micro", [(2, 8), (4, 8), (4, 2), (3, 5)])
def test_1f1b_bounds_micro_batches_in_flight(stages, micro):
    for s in range(stages):
        order = one_f_one_b_order(s, stages, micro)
        assert sorted(order) == sorted(gpipe_order(micro))  # every F and B once
        assert [i for k, i in order if k == "F"] == list(range(micro))
        assert [i for k, i in order if k == "B"] == list(range(micro))
        assert max_in_flight(order) == min(micro, stages - s)
    assert max_in_flight(gpipe_order(micro)) == micro


def test_bubble_formula():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_activation_meter_counts_saved_storages_once_until_freed():
    lin = nn.Linear(64, 64)
    meter = ActivationMeter(exclude=lin.parameters())
    x = torch.randn(32, 64, requires_grad=True)
    with meter.recording():
        y = lin(x)  # saves x (the weight is a parameter: not counted)
        z = (y * y).sum()  # saves y once (both operands are y)
    assert meter.live_bytes == 2 * 32 * 64 * 4
    z.backward()
    del y, z
    assert meter.live_bytes == 0 and meter.peak_bytes == 2 * 32 * 64 * 4


def test_stage_arguments_are_checked_before_any_communication():
    import torch.distributed as dist

    from shardwise.pipeline import PipelineStage

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        module = nn.Linear(2, 2)
        with pytest.raises(ValueError, match="unknown transport 'tcp'"):
            PipelineStage(module, 0, 1, transport="tcp")
        with pytest.raises(ValueError, match="stage_index=1 is outside 0..0"):
            PipelineStage(module, 1, 1)
        with pytest.raises(TypeError):
            PipelineStage(module, 0, 1, dw_builder=None)
        with pytest.warns(UserWarning, match="input_args/output_args are not needed"):
            PipelineStage(module, 0, 1, input_args=torch.zeros(2))
    finally:
        dist.destroy_process_group()
