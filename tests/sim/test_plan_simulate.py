"""`shardwise plan --simulate`: the JSON record, the ZeRO paper's Table 1 from dry runs, the
8,192-rank dry run of a 7B shape, and one-line errors for bad input."""

from __future__ import annotations

import json
import math

import pytest

from shardwise.cli.main import main
from shardwise.sim.models import hf_model
from tests.sim.configs import llama_file

# Rajbhandari et al., "ZeRO" (SC 2020), Table 1: 7.5B parameters, 64 GPUs, K = 12, GB per rank
TABLE_1_AT_64 = {"ddp": 120e9, "zero1": 31.4e9, "zero2": 16.6e9, "fsdp": 1.88e9}
# a GPT-shaped 7.5B model: 12 d^2 per layer with d = 2048, 149 layers, byte-level vocabulary;
# its tensors are small beside a rank's share, so ZeRO's whole-parameter partition balances
GPT_7_5B = ["--n-layer", "149", "--d-model", "2048", "--n-head", "16", "--vocab-size", "256"]


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--simulate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_rows_gain_simulated_figures_and_the_record_the_dry_run_cost(capsys, tmp_path):
    record = _plan_json(capsys, "--hf-config", str(llama_file(tmp_path)), "--nproc", "64",
                        "--strategy", "fsdp", "--rank", "5")
    rows = {r["strategy"]: r for r in record["rows"]}
    sim = rows["fsdp"]["simulated"]
    assert set(sim) == {"params", "grads", "optimizer", "model_state", "peak_gathered",
                        "sent_bytes", "collectives"}
    assert sim["model_state"] == sim["params"] + sim["grads"] + sim["optimizer"]
    assert abs(sim["model_state"] - rows["fsdp"]["model_state"]) <= 0.01 * sim["model_state"]
    assert set(sim["sent_bytes"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert sim["collectives"] > 0 and sim["peak_gathered"] > 0
    assert rows["ddp"]["simulated"] is None  # --strategy fsdp: only its rows are simulated
    assert record["simulated_rank"] == 5
    assert record["simulation"]["seconds"] > 0 and record["simulation"]["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_zero_papers_table_1_from_the_simulation(capsys):
    record = _plan_json(capsys, *GPT_7_5B, "--nproc", "64", "--precision", "mixed")
    assert abs(record["parameters"] - 7.5e9) <= 0.002 * 7.5e9
    for row in record["rows"]:
        want = TABLE_1_AT_64[row["strategy"]]
        got = row["simulated"]["model_state"]
        assert abs(got - want) <= 0.01 * want, (row["strategy"], got, want)


@pytest.mark.slow
def test_the_8192_rank_fsdp_dry_run_of_a_7b_model_holds_the_padded_layout(capsys):
    """docs/scale.md's command, whose cost (CPU seconds, peak RSS) that page reports as
    measured; no timing is asserted here (test_dry_run.py checks that a dry run's work does not
    grow with the world size). Rank 0 holds ``ceil(rows / 8192)`` rows of every parameter:
    16-bit parameters and gradients, an fp32 master copy and two fp32 moments (2 + 2 + 12 bytes
    per element), and a 4-byte step per parameter."""
    record = _plan_json(capsys, "--hf-config", "docs/scale/llama2-7b.json", "--nproc", "8192",
                        "--strategy", "fsdp", "--precision", "mixed")
    shapes = [p.shape for p in hf_model("docs/scale/llama2-7b.json").parameters()]
    elements = sum(-(-s[0] // 8192) * math.prod(s[1:]) for s in shapes)
    sim = next(r for r in record["rows"] if r["strategy"] == "fsdp")["simulated"]
    assert (sim["params"], sim["grads"]) == (2 * elements, 2 * elements)
    assert sim["optimizer"] == 12 * elements + 4 * len(shapes)
    assert set(sim["sent_bytes"]) == {"all_gather", "reduce_scatter", "all_reduce"}


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1000", "--replicas", "3"], "world size 1000 is not divisible by replicas"),
    (["--nproc", "64", "--tp", "3"], "--tp 3 must divide n_head (4)"),
    (["--nproc", "64", "--rank", "64"], "--rank 64 is outside a world of 64 ranks"),
    (["--params", "7.5B"], "--simulate needs the model's shapes"),
])
def test_bad_input_is_a_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--simulate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_config_that_is_not_a_model_config_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(SystemExit):
        main(["plan", "--simulate", "--hf-config", str(path), "--nproc", "64"])
    err = capsys.readouterr().err.strip()
    assert "is not a causal LM" in err and "\n" not in err
