"""Interleaved 1F1B: the orders (every micro-batch through every stage once, no deadlock, a
smaller bubble than 1F1B's), and training that equals GPipe and a one-process float64
reference, at 2 and 4 ranks with 2 stages per rank, over point-to-point and over RPC, followed
by an eval that gives the trained reference's loss."""

from __future__ import annotations

import functools

import pytest
import torch

from shardwise.pipeline import interleaved_order, simulate, simulated_bubble
from shardwise.pipeline.stage import bubble_fraction
from tests.harness import run_on_ranks
from tests.pipeline import interleaved_bodies as ib


@functools.cache
def reference():
    return ib.reference()


@pytest.mark.parametrize("ranks,local,micro", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 3, 6),
                                               (4, 2, 3), (2, 2, 1)])
def test_orders_cover_every_micro_batch_and_do_not_deadlock(ranks, local, micro):
    orders = [interleaved_order(r, ranks, local, micro) for r in range(ranks)]
    for order in orders:
        for kind in "FB":
            got = sorted((j, i) for k, j, i in order if k == kind)
            assert got == [(j, i) for j in range(local) for i in range(micro)]
        for j in range(local):  # each stage forwards, and backwards, in micro-batch order
            for kind in "FB":
                seq = [i for k, jj, i in order if (k, jj) == (kind, j)]
                assert seq == list(range(micro))
    simulate(orders)  # raises on a deadlock


def test_one_stage_per_rank_is_1f1b_and_two_halve_the_bubble():
    for ranks, micro in [(2, 4), (4, 4), (4, 8)]:
        assert simulated_bubble(ranks, 1, micro) == pytest.approx(bubble_fraction(ranks, micro))
        two = simulated_bubble(ranks, 2, micro)  # (p - 1) / (2m + p - 1)
        assert two == pytest.approx((ranks - 1) / (2 * micro + ranks - 1))


def test_a_deadlocking_order_is_refused():
    orders = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(orders)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("transport", ["p2p", "rpc"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_interleaved_equals_gpipe_and_the_reference(world_size, transport):
    results = run_on_ranks(world_size, ib.interleaved_and_gpipe, transport)
    ref_losses, ref_grads, ref_after = reference()
    for kind in ("gpipe", "interleaved"):
        grads = {n: g for r in results for n, g in r[kind]["grads"].items()}
        assert grads.keys() == ref_grads.keys(), kind
        for name, g in grads.items():
            assert _close(g, ref_grads[name]), (kind, name)
        losses = [r[kind]["losses"] for r in results if r[kind]["losses"]]
        assert len(losses) == 1, kind  # only the rank of the last stage reports losses
        assert losses[0] == pytest.approx(ref_losses, rel=1e-9, abs=0), kind
    for r in results:
        idle = r["interleaved"]["idle"]
        assert idle is None if transport == "rpc" else 0 <= idle < 1
        assert r["interleaved"]["grads_kept"]  # eval left no gradient behind
    evals = [r["interleaved"]["eval"] for r in results if r["interleaved"]["eval"] is not None]
    assert evals == [pytest.approx(ref_after, rel=1e-9, abs=0)]  # the trained model's loss


def test_bad_stages_are_clear_errors():
    for messages in run_on_ranks(2, ib.bad_interleaved):
        one, no_loss, five, gpipe, wrong_rank = messages
        assert "this rank holds stages" in one and "got stages" in one
        assert "needs a loss_fn" in no_loss
        assert "5 micro-batches" in five and "multiple of 2" in five
        assert "one stage per rank" in gpipe and "ScheduleInterleaved1F1B" in gpipe
        assert "runs on the group's rank k % 2" in wrong_rank


def test_bench_notes_give_each_schedules_bubble():
    from shardwise.bench.pipeline import bubble_lines

    def row(formula, mean):
        return {"median_step_s": 0.1, "extra": {"bubble_formula": formula, "bubble_mean": mean}}

    summary = {"torch-1f1b": row(0.2, 0.25), "shardwise-1f1b": row(0.2, 0.22),
               "shardwise-interleaved": row(0.111, 0.15)}
    summary["shardwise-interleaved"]["extra"]["own_idle_per_rank"] = [0.1, 0.2]
    assert bubble_lines(summary) == [
        "bubble 1f1b: formula 0.2, measured mean over ranks shardwise 0.22, torch 0.25",
        "bubble interleaved: formula 0.111, measured mean over ranks shardwise 0.15; our "
        "per-step accounting's mean 0.15"]


@pytest.mark.slow
def test_bench_runs_interleaved_beside_torchs(tmp_path):
    import json

    from shardwise.cli.main import main

    tiny = ["--nproc", "2", "--rounds", "1", "--steps", "2", "--warmup", "1", "--n-layer", "2",
            "--d-model", "32", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
            "--microbatches", "2", "--only", "shardwise-1f1b,torch-interleaved,"
            "shardwise-interleaved", "--out", str(tmp_path)]
    assert main(["bench", "pipeline", *tiny]) == 0
    record = json.loads((tmp_path / "pipeline.json").read_text())
    extra = {k: v["extra"] for k, v in record["impls"].items()}
    assert extra["shardwise-interleaved"]["bubble_formula"] == round(1 / 5, 3)  # 1/(2*2+1)
    assert extra["shardwise-1f1b"]["bubble_formula"] == round(1 / 3, 3)
    assert [r["schedule"] for r in record["per_schedule"]] == ["interleaved"]
    assert any(n.startswith("bubble interleaved: formula 0.2") for n in record["notes"])
