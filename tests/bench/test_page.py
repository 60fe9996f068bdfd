"""docs/benchmarks.md is generated from docs/records/: the committed page is what the records
render, and a section holds what its record holds (when, where, the command, the table, the
limit lines, the plot)."""

import json
from pathlib import Path

import pytest

from shardwise.bench.limits import PATTERNS, pipeline_critical_path_ms
from shardwise.bench.page import main as page_main
from shardwise.bench.page import render_page
from shardwise.bench.sidebyside import limit_figures

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_what_the_committed_records_render():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page == render_page(ROOT / "docs" / "records"), (
        "docs/benchmarks.md differs from its records: run `shardwise bench --render-page`")


def _impl(step_s, extra=None):
    return {"median_step_s": step_s, "round_median_step_s": [step_s], "peak_rss_mib": [300.0],
            "round_peak_rss_mib": [300.0], "ratio": None, "extra": extra or {}}


def _fsdp_record():
    impls = {"torch-fsdp2": _impl(0.030), "shardwise-fsdp": _impl(0.015),
             "local-fsdp": _impl(0.010, {"pattern_comm_ms": 2.5})}
    for s in impls.values():
        s["ratio"] = s["median_step_s"] / 0.030
    limits = limit_figures(impls, None, {"torch-fsdp2": "local-fsdp",
                                         "shardwise-fsdp": "local-fsdp"}, PATTERNS["fsdp"])
    return {"bench": "fsdp", "description": "FSDP against FSDP2", "baseline": "torch-fsdp2",
            "meta": {"date": "2030-01-02 03:04 UTC", "machine": "a test box", "device": "cpu",
                     "load_before": "0.1", "load_after": "0.2",
                     "command": "shardwise bench fsdp --rounds 1"},
            "settings": {"nproc": 2, "rounds": 1, "steps": 1, "warmup": 0, "omp_threads": "1"},
            "impls": impls, "limits": limits}


def test_a_pattern_limit_is_the_local_step_plus_what_the_local_row_measured():
    limits = _fsdp_record()["limits"]
    assert set(limits["impls"]) == {"torch-fsdp2", "shardwise-fsdp"}  # not the local row
    ours = limits["impls"]["shardwise-fsdp"]
    assert ours["compute_ms"] == pytest.approx(10.0) and ours["exposed_comm_ms"] == 2.5
    assert ours["limit_ms"] == pytest.approx(12.5)
    assert ours["step_over_limit"] == pytest.approx(15.0 / 12.5)
    assert limits["impls"]["torch-fsdp2"]["step_over_limit"] == pytest.approx(30.0 / 12.5)


def test_a_row_with_its_own_critical_path_brings_its_limit():
    # pipeline: two stages busy 40 and 60 ms over 4 micro-batches, optimizer steps 3 and 5 ms:
    # (40 + 60) / 4 + 3 / 4 * 60 + 5 = 75 ms on the critical path
    compute = pipeline_critical_path_ms([40.0, 60.0], [3.0, 5.0], 4)
    assert compute == pytest.approx(75.0)
    impls = {"shardwise-1f1b": _impl(0.090, {"limit_compute_ms": compute,
                                             "exposed_comm_ms": 5.0})}
    row = limit_figures(impls)["impls"]["shardwise-1f1b"]
    assert row["limit_ms"] == pytest.approx(80.0)
    assert row["step_over_limit"] == pytest.approx(90.0 / 80.0)


def test_a_section_holds_its_records_figures(tmp_path):
    (tmp_path / "fsdp.json").write_text(json.dumps(_fsdp_record()))
    (tmp_path / "fsdp.png").write_bytes(b"")
    bare = {**_fsdp_record(), "bench": "tp", "description": "TP"}
    del bare["meta"], bare["limits"]
    (tmp_path / "tp.json").write_text(json.dumps(bare))
    page = render_page(tmp_path)
    fsdp = page[page.index("## fsdp: FSDP against FSDP2"):page.index("## tp: TP")]
    assert "2030-01-02 03:04 UTC on a test box" in fsdp and "0.1 before, 0.2 after" in fsdp
    assert "`shardwise bench fsdp --rounds 1`" in fsdp
    assert "| shardwise-fsdp | 15.0 | 15.0 | 0.500 | 300 |" in fsdp
    assert "limit      12.5 ms   step/limit 1.200" in fsdp
    assert "![fsdp](records/fsdp.png)" in fsdp
    tp = page[page.index("## tp: TP"):]
    assert "Date, machine and load are not in this record." in tp
    assert "has no limit line" in tp and "records/tp.png" not in tp
    for name in PATTERNS:  # every strategy's non-overlappable part is stated
        assert f"(`{name}`): {PATTERNS[name]}." in page


def test_render_page_writes_and_checks(tmp_path, capsys):
    (tmp_path / "fsdp.json").write_text(json.dumps(_fsdp_record()))
    page = tmp_path / "page.md"
    assert page_main(["--records", str(tmp_path), "--check", str(page)]) == 1
    assert page_main(["--records", str(tmp_path), str(page)]) == 0
    assert page_main(["--records", str(tmp_path), "--check", str(page)]) == 0
    assert page.read_text() == render_page(tmp_path)
    assert page_main(["--records", str(tmp_path / "none"), str(page)]) == 2
    assert "no records directory" in capsys.readouterr().err
