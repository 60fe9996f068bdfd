"""The pipelined demo GPT trains exactly like the unsplit model: 5 AdamW steps, losses equal to
1e-5 relative, at 2 and 4 stages, GPipe and 1F1B, over point-to-point and over RPC, and with two
data-parallel replicas of a 2-stage pipeline (4 ranks)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import run_on_ranks
from tests.pipeline import bodies

CASES = [(2, 2), (4, 4), (4, 2)]  # (world size, stages): 4 ranks at 2 stages = dp 2


@functools.cache
def reference() -> list[float]:
    return bodies.reference_losses()


@pytest.mark.parametrize("transport", ["p2p", "rpc"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("world_size,stages", CASES)
def test_losses_equal_unsplit_model(world_size, stages, schedule, transport):
    results = run_on_ranks(world_size, bodies.train_losses, stages, schedule, transport)
    last = [r for r in results if r["last"]]
    assert len(last) == world_size // stages
    ref = reference()
    for step, expected in enumerate(ref):
        # each replica's loss is its half of the batch; their mean is the whole batch's loss
        got = sum(r["losses"][step] for r in last) / len(last)
        assert abs(got - expected) <= 1e-5 * abs(expected), (step, got, expected)
    assert all(not r["losses"] for r in results if not r["last"])
    assert all(r["peak_activation_bytes"] is None for r in results)  # not measured by default
    # with two replicas, each stage's DDP (one bucket: the stages are small) reduces once per
    # step, after the micro-batches' gradients are accumulated; none without replicas
    expected = bodies.STEPS if world_size > stages else 0
    assert [r["all_reduces"] for r in results] == [expected] * world_size


@pytest.mark.parametrize("transport", ["p2p", "rpc"])
def test_single_stage_is_the_plain_model(transport):
    results = run_on_ranks(1, bodies.train_losses, 1, "1f1b", transport)
    for got, expected in zip(results[0]["losses"], reference(), strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected)


@pytest.mark.parametrize("transport", ["p2p", "rpc"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_eval_runs_forwards_only_and_training_goes_on(schedule, transport):
    """``schedule.eval`` gives the unsplit model's loss, leaves no gradient, no graph and no
    pending receive behind: two evals then a training step on the same pipeline all agree."""
    results = run_on_ranks(2, bodies.eval_then_train, transport, schedule)
    last = next(r for r in results if r["last"])
    expected = reference()[0]  # the untrained model's loss on batch 0
    assert last["evals"][0] == last["evals"][1]
    assert abs(last["evals"][0] - expected) <= 1e-5 * expected
    assert abs(last["train"] - expected) <= 1e-5 * expected
    assert all(r["no_grad_after_eval"] and r["grads_after_train"] for r in results)


def test_the_next_rounds_activation_cannot_land_in_this_rounds_slot():
    """The cause of an intermittent hang of eval-then-train over RPC: stage 0 finished an eval
    and sent the training step's micro-batch 0 before stage 1 had taken the eval's micro-batch
    0, and the second delivery replaced the first under the same key; the training step then
    waited for an activation already consumed. Keys now carry the schedule call's round, and a
    second delivery under one key is an error instead of a silent overwrite."""
    from shardwise.pipeline import rpc_transport as rt

    name = "test-rounds/stage1"
    first, second = torch.zeros(2), torch.ones(2)
    rt.deliver_activation(name, 0, 0, 11, first)
    rt.deliver_activation(name, 1, 0, 12, second)  # the next round, early
    box = rt._box(name)
    assert box.take(("F", 0, 0), "round 0") == (11, first)
    assert box.take(("F", 1, 0), "round 1") == (12, second)
    rt.deliver_activation(name, 2, 0, 13, first)
    with pytest.raises(RuntimeError, match="delivered twice"):
        rt.deliver_activation(name, 2, 0, 14, second)
    box.take(("F", 2, 0), "round 2")
