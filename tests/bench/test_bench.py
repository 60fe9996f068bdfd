"""`shardwise bench`: the table, the JSON record that holds every number it prints, the PNG,
the Markdown rendering, and bad input."""

import json
import re
import struct

import pytest

from shardwise.bench.records import PLOT_SIZE_PX, format_table, plot, render_markdown
from shardwise.cli.main import main

TINY = ["--nproc", "2", "--rounds", "2", "--steps", "2", "--warmup", "1", "--n-layer", "1",
        "--d-model", "32", "--n-head", "2", "--seq-len", "8",
        "--only", "torch-fsdp2,shardwise-fsdp"]
FSDP_ROWS = "torch-fsdp2,shardwise-fsdp,local-fsdp"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _impl_rows(table, impls):
    """implementation -> every number on its row (and on its extra-figures line)."""
    rows, current = {}, None
    for line in table.splitlines():
        if line.startswith("ratio: "):  # the table ends; limit lines name the rows again
            break
        name = line.split()[0] if line.strip() else ""
        if name in impls:
            current = name
            rows[name] = [float(v) for v in re.findall(r"-?\d+\.?\d*", line[len(name):])]
        elif current and line.startswith(" ") and line.strip().startswith("{"):
            rows[current] += [float(v) for v in re.findall(r"-?\d+\.?\d*", line)]
    return rows


def _printed_numbers(s):
    """What the table prints of one implementation's record, rounded as printed."""
    nums = [round(s["median_step_s"] * 1e3, 1)]
    nums += [round(t * 1e3, 1) for t in s["round_median_step_s"]]
    nums += [round(s["ratio"], 3)]
    nums += [round(m) for m in s["peak_rss_mib"]]
    nums += [float(v) for v in re.findall(r"-?\d+\.?\d*", json.dumps(s["extra"]))]
    return nums


@pytest.mark.slow  # ~18 s; CI's benchmark smoke run also runs bench fsdp
def test_bench_fsdp_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "records"
    assert main(["bench", "fsdp", *TINY[:-1], FSDP_ROWS, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    record = json.loads((out / "fsdp.json").read_text())
    impls = record["impls"]
    assert list(impls) == ["torch-fsdp2", "shardwise-fsdp", "local-fsdp"]
    assert record["settings"]["rounds"] == 2 and record["baseline"] == "torch-fsdp2"
    rows = _impl_rows(table, impls)
    for impl, s in impls.items():
        assert len(s["round_median_step_s"]) == 2 and len(s["peak_rss_mib"]) == 2
        assert rows[impl] == pytest.approx(_printed_numbers(s), abs=1e-9), impl
        if impl != "local-fsdp":
            assert s["extra"]["state_MiB"] > 0
    assert impls["torch-fsdp2"]["ratio"] == 1.0
    # the limit of both FSDPs: local-fsdp's step plus the root unit's gather and reduce-scatter
    local = impls["local-fsdp"]
    assert local["extra"]["pattern_comm_ms"] > 0
    limits = record["limits"]
    assert set(limits["impls"]) == {"torch-fsdp2", "shardwise-fsdp"}
    for impl, row in limits["impls"].items():
        assert row["limit_ms"] == pytest.approx(local["median_step_s"] * 1e3
                                                + local["extra"]["pattern_comm_ms"])
        assert row["step_over_limit"] == pytest.approx(
            impls[impl]["median_step_s"] * 1e3 / row["limit_ms"])
        assert f"step/limit {row['step_over_limit']:.3f}" in table
    assert record["meta"]["command"].startswith("shardwise bench fsdp --nproc 2")
    assert "--out" not in record["meta"]["command"] and record["meta"]["date"].endswith("UTC")
    width, height = png_size(out / "fsdp.png")
    assert (width, height) == PLOT_SIZE_PX == (record["plot"]["width_px"],
                                               record["plot"]["height_px"])
    assert f"wrote {out / 'fsdp.json'} and {out / 'fsdp.png'}" in table


def _record():
    impl = {"median_step_s": 0.0123, "round_median_step_s": [0.012, 0.0131],
            "peak_rss_mib": [300.4, 310.6], "round_peak_rss_mib": [310.6, 305.0],
            "ratio": 1.0, "extra": {"state_MiB": 1.5}}
    return {"bench": "ddp", "description": "DDP: ours against torch's", "baseline": "torch-ddp",
            "settings": {"nproc": 2, "rounds": 2, "steps": 3, "warmup": 1, "omp_threads": "1"},
            "impls": {"torch-ddp": impl, "shardwise-ddp": {**impl, "ratio": 0.5}}}


def test_plot_and_markdown_come_from_the_record(tmp_path):
    record = _record()
    plot(record, tmp_path / "ddp.png")
    assert png_size(tmp_path / "ddp.png") == PLOT_SIZE_PX
    md = render_markdown([record])
    assert "| shardwise-ddp | 12.3 | 12.0 / 13.1 | 0.500 | 300 / 311 | state_MiB 1.5 |" in md
    assert md.startswith("### ddp: DDP: ours against torch's")
    assert "12.3  12.0 / 13.1" in format_table(record)
    no_memory = {**record, "impls": {k: {**v, "peak_rss_mib": None, "round_peak_rss_mib": None}
                                     for k, v in record["impls"].items()}}
    plot(no_memory, tmp_path / "time-only.png")
    assert png_size(tmp_path / "time-only.png") == PLOT_SIZE_PX


def test_render_md_command_reads_saved_records(tmp_path, capsys):
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(_record()))
    assert main(["bench", "--render-md", str(path)]) == 0
    assert "| torch-ddp | 12.3 |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "--render-md", str(tmp_path / "bad.json")]) == 2
    assert "is not a benchmark record (missing bench" in capsys.readouterr().err


def test_bad_bench_input_is_named(tmp_path, capsys):
    assert main(["bench", "fsdpp"]) == 2
    err = capsys.readouterr().err
    assert ("unknown benchmark 'fsdpp'; known: ddp, zero, fsdp, tp, collectives, rpc, mesh, "
            "pipeline") in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "fsdp", "--out", str(blocker / "sub")]) == 2
    assert f"--out {blocker / 'sub'} is not writable" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "fsdp", "--only", "torch-fsdp3"])
    assert exit_info.value.code == 2
    assert "unknown implementation(s) torch-fsdp3" in capsys.readouterr().err


def test_device_cuda_without_a_cuda_device_is_one_line_and_exit_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["bench", "ddp", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err == "shardwise bench: no CUDA device is present (--device cuda needs one); " \
                  "nothing was run\n"
    assert main(["bench", "pipeline", "--device=cuda"]) == 2  # the same line, whatever NAME
    assert "no CUDA device is present" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, args", [
    ("tp", ["--d-model", "32", "--hidden", "64", "--tokens", "8"]),
    ("pipeline", ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "8",
                  "--batch-size", "4", "--microbatches", "2", "--only",
                  "torch-gpipe,shardwise-1f1b"]),
])
def test_tp_and_pipeline_records_have_limit_lines(name, args, tmp_path, capsys):
    tiny = ["--nproc", "2", "--rounds", "1", "--steps", "2", "--warmup", "1"]
    assert main(["bench", name, *tiny, *args, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / f"{name}.json").read_text())
    rows = [i for i in record["impls"] if not i.startswith("local")]
    assert set(record["limits"]["impls"]) == set(rows)
    for row in record["limits"]["impls"].values():
        assert row["limit_ms"] == pytest.approx(row["compute_ms"] + row["exposed_comm_ms"])
        assert row["exposed_comm_ms"] > 0 and row["compute_ms"] > 0


def test_ddp_bench_defaults_are_shardwise_trains():
    from shardwise.bench.ddp import _Defaults
    from shardwise.cli.train_args import TrainConfig

    train = TrainConfig()
    for name, value in vars(_Defaults()).items():
        assert getattr(train, name) == value, name


def test_a_record_of_figures_rpc_is_tabled_plotted_and_rendered(tmp_path):
    from shardwise.bench.rpc import FIGURES, _summary

    def run(scale):
        return {k: scale * (i + 1) for i, k in enumerate(FIGURES)}

    record = {"bench": "rpc", "description": "rpc", "kind": "figures", "baseline": "torch",
              "settings": {"nproc": 2, "rounds": 2}, "figures": FIGURES,
              "impls": _summary({"shardwise-tcp": [run(1.0), run(3.0)],
                                 "torch": [run(2.0), run(2.0)]})}
    ours = record["impls"]["shardwise-tcp"]
    assert ours["figures"]["lat_med_us"] == 2.0 and ours["ratio"]["lat_med_us"] == 1.0
    assert ours["round_figures"]["echo_GBps"] == [4.0, 12.0]
    table = format_table(record)
    assert "1 KB echo, median (us)" in table and "2.00 (1.00x)" in table
    assert "| large tensor echoed (GB/s) | 8.00 (1.00x) | 8.00 | >=1.5 |" in (
        render_markdown([record]))
    plot(record, tmp_path / "rpc.png")
    assert png_size(tmp_path / "rpc.png") == PLOT_SIZE_PX


def test_mesh_comparison_is_in_the_record_and_printed_after_the_table():
    from shardwise.bench.mesh import comparison, comparison_lines

    record = _record()
    ours = {**record["impls"]["torch-ddp"], "median_step_s": 0.006, "peak_rss_mib": [301, 300]}
    impls = {"torch-fsdp2-hsdp": record["impls"]["torch-ddp"], "shardwise-hsdp": ours}
    rows = comparison(impls)  # the FULL_SHARD pair did not run: no row for it
    assert [(r["ours"], r["torch"]) for r in rows] == [("shardwise-hsdp", "torch-fsdp2-hsdp")]
    assert rows[0]["step_ratio"] == pytest.approx(0.006 / 0.0123)
    assert rows[0]["higher_ranks"] == [0]
    mesh_record = {**record, "bench": "mesh", "impls": impls, "comparison": rows,
                   "notes": comparison_lines(rows)}
    table = format_table(mesh_record)
    assert table.endswith("shardwise-hsdp / torch-fsdp2-hsdp: step time 0.488x (bar <= 0.7); "
                          "peak RSS per rank 301/300 vs 300/311 MiB (higher on ranks [0])")


def test_pipeline_per_schedule_is_in_the_record_and_printed_after_the_table():
    from shardwise.bench.pipeline import per_schedule, per_schedule_lines

    impl = _record()["impls"]["torch-ddp"]
    impls = {"torch-1f1b": impl, "shardwise-1f1b": {**impl, "median_step_s": 0.0246}}
    rows = per_schedule(impls)  # GPipe did not run: no row for it
    assert rows == [{"schedule": "1f1b", "ours_step_s": 0.0246, "torch_step_s": 0.0123,
                     "ratio": 2.0}]
    assert per_schedule_lines(rows) == ["1f1b: ours 24.6 ms, torch 12.3 ms per step: "
                                        "2.000x torch's"]


def test_physical_limit_is_the_local_step_plus_exposed_communication():
    from shardwise.bench.sidebyside import limit_figures

    record = _record()
    impls = record["impls"]
    impls["local-adamw"] = {**impls["torch-ddp"], "median_step_s": 0.002, "extra": {}}
    impls["shardwise-ddp"] = {**impls["shardwise-ddp"], "median_step_s": 0.006,
                              "extra": {"exposed_comm_ms": 1.0}}
    record["limits"] = limits = limit_figures(impls, "local-adamw")
    assert limits["local"] == "local-adamw" and limits["local_step_ms"] == pytest.approx(2.0)
    assert list(limits["impls"]) == ["shardwise-ddp"]  # rows without exposed_comm_ms: none
    row = limits["impls"]["shardwise-ddp"]
    assert row["limit_ms"] == pytest.approx(3.0) and row["step_over_limit"] == pytest.approx(2.0)
    line = "shardwise-ddp               limit       3.0 ms   step/limit 2.000"
    assert line in format_table(record) and line in render_markdown([record])
    assert "local-adamw step (2.0 ms)" in format_table(record)


def test_bench_ddp_records_exposed_communication_and_limits(tmp_path, capsys):
    tiny = [*TINY[:-1], "shardwise-ddp-powersgd,local-adamw", "--rounds", "1"]
    assert main(["bench", "ddp", *tiny, "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    record = json.loads((tmp_path / "ddp.json").read_text())
    exposed = record["impls"]["shardwise-ddp-powersgd"]["extra"]["exposed_comm_ms"]
    assert "exposed_comm_ms" not in record["impls"]["local-adamw"]["extra"]
    local_ms = record["impls"]["local-adamw"]["median_step_s"] * 1e3
    row = record["limits"]["impls"]["shardwise-ddp-powersgd"]
    assert row["limit_ms"] == pytest.approx(local_ms + exposed)
    assert f"limit {row['limit_ms']:>9.1f} ms   step/limit {row['step_over_limit']:.3f}" in table
