"""Activation memory per stage (1F1B below GPipe at 8 micro-batches, by the library's saved-
tensor accounting), the measured bubble, and clear errors for bad input."""

from __future__ import annotations

import pytest

from tests.harness import run_on_ranks
from tests.pipeline import bodies


@pytest.mark.parametrize("transport", ["p2p", "rpc"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_1f1b_keeps_fewer_activations_than_gpipe(world_size, transport):
    results = run_on_ranks(world_size, bodies.activation_peaks, transport)
    for r in results:
        s = r["stage"]
        assert 0 < r["1f1b"] < r["gpipe"], r
        assert r["gpipe_live_after"] == 0 and r["1f1b_live_after"] == 0, r  # all freed
        if transport == "p2p" and s > 0:
            # every micro-batch saves the same bytes: at most (p - s) of 8 alive under 1F1B
            assert r["1f1b"] * 8 == r["gpipe"] * (world_size - s), r
        if transport == "p2p":
            assert 0 <= r["gpipe_idle"] < 1 and 0 <= r["1f1b_idle"] < 1, r
        else:
            assert r["gpipe_idle"] is None  # backward ran in RPC threads: not measured


def test_stage_count_must_match_the_group():
    for message in run_on_ranks(2, bodies.bad_stage_count):
        assert "num_stages=3 does not match the pipeline group, which has 2 ranks" in message


def test_micro_batches_must_divide_the_batch():
    for message in run_on_ranks(2, bodies.bad_microbatches):
        assert "3 micro-batches do not divide the" in message and "batch of 8" in message
