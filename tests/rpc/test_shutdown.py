"""Graceful shutdown waits for every worker (torch's barrier), and a dead one is an error."""

from __future__ import annotations

from tests.rpc.scenarios import PAUSE, SHORT, STEPS, lines, run


def test_parameter_server_that_shuts_down_at_once_serves_until_trainers_finish(tmp_path):
    # The trainers work STEPS * PAUSE = 3 s, three times the RPC timeout every worker runs
    # with: a shutdown bounded by any RPC-level limit would leave them without a server.
    assert STEPS * PAUSE >= 3 * SHORT
    ranks = run("ps_shutdown", 3, extra_env={"SCENARIO_DIR": str(tmp_path)})
    for code, text in ranks:
        assert code == 0, text
        assert lines(text)["shutdown"] == "returned", text
    assert lines(ranks[0][1])["trainers done before ps left"] == "True"
    for _, text in ranks[1:]:
        assert lines(text)["weights equal"] == "True", text


def test_worker_that_dies_before_shutdown_is_a_clear_error_for_the_others(tmp_path):
    ranks = run("ps_dead_trainer", 3, extra_env={"SCENARIO_DIR": str(tmp_path)})
    assert ranks[1][0] == 3  # it died
    for rank in (0, 2):
        code, text = ranks[rank]
        assert code == 0, text
        out = lines(text)
        assert out["shutdown"].startswith("WorkerDied: "), text
        assert "worker 'trainer1' (rank 1) died before calling shutdown()" in out["shutdown"]
    # the live trainer was still served to the end
    assert lines(ranks[2][1])["weights equal"] == "True"
    assert lines(ranks[0][1])["trainers done before ps left"] == "True"
