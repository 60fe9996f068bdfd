"""The regression gate's judgement (benchmarks/compare.py), on made-up records: no processes.
A row is "slower" only when every round is worse and the median is beyond the noise, and the
noise includes how far torch's own rows (the same code in both trees) moved."""

from benchmarks.compare import MIN_ROUNDS, figures_of, judge, verdict


def _steps(**ms: float) -> dict:
    return {"impls": {impl: {"median_step_s": t / 1e3, "peak_rss_mib": [100.0, 100.0]}
                      for impl, t in ms.items()}}


def _verdicts(new: list[dict], old: list[dict]) -> dict[str, str]:
    return {row["row"]: row["verdict"] for row in judge(new, old)}


def test_identical_trees_are_within_noise():
    runs = [_steps(**{"torch-ddp": 100.0, "shardwise-ddp": 90.0})] * MIN_ROUNDS
    assert set(_verdicts(runs, runs).values()) == {"within noise"}


def test_a_slowdown_in_every_round_beyond_the_noise_is_slower():
    old = [_steps(**{"torch-ddp": 100.0, "shardwise-ddp": 90.0 + i}) for i in range(3)]
    new = [_steps(**{"torch-ddp": 100.0, "shardwise-ddp": 1.2 * (90.0 + i)}) for i in range(3)]
    verdicts = _verdicts(new, old)
    assert verdicts["shardwise-ddp step (ms)"] == "slower"
    assert verdicts["torch-ddp step (ms)"] == "within noise"
    assert _verdicts(old, new)["shardwise-ddp step (ms)"] == "faster"


def test_what_moved_torchs_rows_is_noise_for_ours():
    old = [_steps(**{"torch-ddp": 100.0, "shardwise-ddp": 90.0})] * 3
    new = [_steps(**{"torch-ddp": 130.0, "shardwise-ddp": 108.0})] * 3  # the machine, not us
    assert _verdicts(new, old)["shardwise-ddp step (ms)"] == "within noise"


def test_one_round_that_is_worse_among_better_ones_is_not_slower():
    old = [_steps(**{"shardwise-ddp": 90.0})] * 3
    new = [_steps(**{"shardwise-ddp": t}) for t in (150.0, 80.0, 85.0)]
    assert _verdicts(new, old)["shardwise-ddp step (ms)"] != "slower"


def test_a_figure_where_higher_is_better_is_worse_when_it_falls():
    def record(gbps: float) -> dict:
        return {"kind": "figures",
                "figures": {"echo_GBps": {"higher_is_better": True},
                            "lat_med_us": {"higher_is_better": False}},
                "impls": {"shardwise-shm": {"figures": {"echo_GBps": gbps, "lat_med_us": 100.0}}}}

    rows = {r["row"]: r for r in judge([record(1.0)] * 3, [record(2.0)] * 3)}
    assert rows["shardwise-shm echo_GBps"]["ratio"] == 2.0
    assert rows["shardwise-shm echo_GBps"]["verdict"] == "slower"
    assert rows["shardwise-shm lat_med_us"]["verdict"] == "within noise"


def test_too_few_rounds_give_no_verdict():
    assert verdict([1.5] * (MIN_ROUNDS - 1))["verdict"].startswith("no verdict")
    assert verdict([1.5] * MIN_ROUNDS)["verdict"] == "slower"


def test_rows_one_tree_lacks_are_left_out_and_rss_is_compared():
    new, old = [_steps(**{"a": 1.0, "b": 1.0})] * 3, [_steps(**{"a": 1.0})] * 3
    assert {r["row"] for r in judge(new, old)} == {"a step (ms)", "a peak RSS (MiB)"}
    assert figures_of(new[0])["b peak RSS (MiB)"] == (100.0, False)
