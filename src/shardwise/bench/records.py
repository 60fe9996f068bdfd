"""A benchmark's record: the table it prints, the JSON it saves, the PNG it draws, and the
Markdown that docs/benchmarks.md is made of.

A record is a dict: ``bench``, ``description``, ``settings`` (every argument of the run),
``baseline`` and ``impls``: implementation -> ``median_step_s``, ``round_median_step_s`` (one
per round), ``peak_rss_mib`` (per rank, the most over rounds, or None when not measured),
``round_peak_rss_mib`` (per round, the most over ranks), ``ratio`` (to the baseline) and
``extra`` (figures the benchmark adds, such as model-state MiB); optionally ``time_label``
(what one timed unit is: "step time" unless said); optionally ``notes`` (lines printed after
the table, made from numbers the record holds) and ``limits`` (the physical limit of rows that
report one: ``local``, ``local_step_ms``, ``pattern`` (what the strategy cannot overlap) and
per implementation ``compute_ms``, ``exposed_comm_ms``, ``limit_ms``, ``step_over_limit``; see
sidebyside.limit_figures and limits.py); ``meta`` (``date`` in UTC, ``machine``, ``device``,
``load_before`` / ``load_after``: the load average around the run; see ``run_meta``);
optionally ``failed`` (rows whose ranks failed, left out). Every number the table prints is one
of these, rounded as printed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Iterable
from pathlib import Path

PLOT_SIZE_PX = (1000, 480)  # width, height of every PNG
_DPI = 100


def format_table(record: dict) -> str:
    if record.get("kind") == "figures":
        return _figures_table(record)
    lines = [f"{record['bench']}: {record['description']}",
             *filter(None, [_meta_line(record)]), _settings_line(record),
             f"{'implementation':<28}{'median step (ms)':>18}  {'round medians (ms)':<24}"
             f"{'ratio':>7}  peak RSS per rank (MiB)"]
    for impl, s in record["impls"].items():
        rounds = " / ".join(f"{t * 1e3:.1f}" for t in s["round_median_step_s"])
        ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "-"
        rss = " / ".join(f"{m:.0f}" for m in s["peak_rss_mib"]) if s["peak_rss_mib"] else "-"
        lines.append(f"{impl:<28}{s['median_step_s'] * 1e3:>18.1f}  {rounds:<24}{ratio:>7}  {rss}")
        if s["extra"]:
            lines.append(f"{'':<28}{json.dumps(s['extra'])}")
    lines.append(f"ratio: median step / {record['baseline']}'s")
    lines += record.get("notes", [])  # a benchmark's own lines, from numbers in its record
    if "limits" in record:
        lines += format_limits(record["limits"])
    lines += [f"FAILED {impl}: {why}" for impl, why in record.get("failed", {}).items()]
    return "\n".join(lines)


def run_meta(device: str = "cpu") -> dict:
    """When and where a run happens: UTC time, the machine, the device, the load average."""
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_line(), "device": "cpu",
            "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda" and torch.cuda.is_available():
        meta["device"] = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
                          f"CUDA {torch.version.cuda}, NCCL")
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    meta["load_before"] = f"{load} on {os.cpu_count()} CPUs"
    return meta


def machine_line() -> str:
    """CPU model, logical CPUs, memory and OS, from /proc where it exists."""
    model, mem = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB memory"
    except (OSError, ValueError, IndexError):
        pass
    return f"{model}, {os.cpu_count()} CPUs{mem}, {platform.system()} {platform.release()}"


def format_limits(limits: dict) -> list[str]:
    """One line per row with a physical limit: the limit (computation without communication +
    what the pattern cannot overlap) and step / limit."""
    if "local_step_ms" in limits and all(s.get("from", limits["local"]) == limits["local"]
                                         for s in limits["impls"].values()):
        head = (f"physical limit = {limits['local']} step ({limits['local_step_ms']:.1f} ms) "
                "+ the row's exposed communication")
    else:
        head = "physical limit = computation without communication + exposed communication"
    lines = [head + (f"; exposed: {limits['pattern']}" if limits.get("pattern") else "")]
    for impl, s in limits["impls"].items():
        compute = s.get("compute_ms", limits.get("local_step_ms"))
        lines.append(f"{impl:<28}limit {s['limit_ms']:>9.1f} ms   "
                     f"step/limit {s['step_over_limit']:.3f}   "
                     f"(compute {compute:.1f} + communication {s['exposed_comm_ms']:.1f})")
    return lines


def _meta_line(record: dict) -> str | None:
    meta = record.get("meta")
    if not meta:
        return None
    return (f"{meta.get('date', 'date not recorded')}; {meta.get('machine', '')}; device "
            f"{meta.get('device', 'cpu')}; load before {meta.get('load_before', '?')}, after "
            f"{meta.get('load_after', '?')}")


def _settings_line(record: dict) -> str:
    s = record["settings"]
    if {"nproc", "rounds", "steps", "warmup"} <= set(s):
        head = (f"world size {s['nproc']}, {s['rounds']} rounds x {s['steps']} timed steps "
                f"(after {s['warmup']} warm-up), OMP threads per rank {s['omp_threads']}")
        rest = {k: v for k, v in s.items()
                if k not in ("nproc", "rounds", "steps", "warmup", "omp_threads")}
    else:
        head, rest = f"world size {s.get('nproc')}", {k: v for k, v in s.items() if k != "nproc"}
    return head + "; " + ", ".join(f"{k}={v}" for k, v in rest.items() if v not in (None, False))


def save(record: dict, out_dir: str | Path) -> tuple[Path, Path | None]:
    """Write ``NAME.json`` and ``NAME.png`` into ``out_dir`` (made if missing); without
    matplotlib (a bare GPU host) the JSON alone, and None for the PNG."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png: Path | None = out / f"{record['bench']}.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        png = None
    if png is not None:
        plot(record, png)
        record = {**record, "plot": {"file": png.name, "width_px": PLOT_SIZE_PX[0],
                                     "height_px": PLOT_SIZE_PX[1]}}
    path = out / f"{record['bench']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path, png


def plot(record: dict, path: str | Path) -> None:
    """Step time and peak memory per implementation: a bar at the median, a dot per round and
    a line over the rounds' spread (min to max). A record of figures (rpc) gets one panel per
    figure, drawn alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if record.get("kind") == "figures":
        _plot_figures(record, path, plt)
        return

    impls = record["impls"]
    names = list(impls)
    has_memory = any(s["peak_rss_mib"] for s in impls.values())
    fig, axes = plt.subplots(1, 2 if has_memory else 1, squeeze=False,
                             figsize=(PLOT_SIZE_PX[0] / _DPI, PLOT_SIZE_PX[1] / _DPI), dpi=_DPI)
    colors = ["tab:blue" if n.startswith(("shardwise", "all_gather/fast", "reduce_scatter/fast"))
              else "tab:gray" if n.startswith("local") else "tab:orange" for n in names]
    _panel(axes[0][0], names, colors, [impls[n]["median_step_s"] * 1e3 for n in names],
           [[t * 1e3 for t in impls[n]["round_median_step_s"]] for n in names],
           f"{record.get('time_label', 'step time')} (ms, median)")
    limits = record.get("limits", {}).get("impls", {})
    for x, n in enumerate(names):
        if n in limits:
            axes[0][0].hlines(limits[n]["limit_ms"], x - 0.4, x + 0.4, color="tab:red",
                              linewidth=2)
            axes[0][0].annotate(f"{limits[n]['step_over_limit']:.2f}x",
                                (x + 0.4, limits[n]["limit_ms"]), textcoords="offset points",
                                xytext=(2, -3), ha="left", fontsize=7, color="tab:red")
    if has_memory:
        _panel(axes[0][1], names, colors, [max(impls[n]["peak_rss_mib"] or [0]) for n in names],
               [impls[n]["round_peak_rss_mib"] or [] for n in names],
               "peak RSS per rank (MiB, most loaded rank)")
    s = record["settings"]
    fig.suptitle(f"shardwise bench {record['bench']}: world size {s.get('nproc')}, "
                 f"{s.get('rounds', 1)} round(s)")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color="tab:blue", label="shardwise"),
               Patch(color="tab:orange", label="torch (or plain c10d)"),
               Patch(color="tab:gray", label="local: no communication"),
               Line2D([], [], marker="o", color="black", linestyle="", label="each round"),
               Line2D([], [], color="black", label="spread across rounds (min-max)")]
    if limits:
        handles.append(Line2D([], [], color="tab:red", linewidth=2,
                              label="physical limit (step/limit beside it)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(handles) <= 4 else 0.1, 1, 1))
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def _panel(ax, names, colors, heights, rounds, ylabel) -> None:
    xs = range(len(names))
    ax.bar(xs, heights, color=colors, alpha=0.8)
    for x, values in zip(xs, rounds):
        if values:
            ax.plot([x] * len(values), values, "o", color="black", markersize=4)
            ax.vlines(x, min(values), max(values), color="black")
    ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax.set_xlabel("implementation")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max([*heights, *(v for r in rounds for v in r)], default=1) * 1.15)


def render_markdown(records: Iterable[dict]) -> str:
    """docs/benchmarks.md's tables, one per record."""
    parts = []
    for record in records:
        if record.get("kind") == "figures":
            parts.append(_figures_markdown(record))
            continue
        rows = ["| implementation | median step (ms) | round medians (ms) | ratio | "
                "peak RSS per rank (MiB) | other |", "|---|---|---|---|---|---|"]
        for impl, s in record["impls"].items():
            rounds = " / ".join(f"{t * 1e3:.1f}" for t in s["round_median_step_s"])
            ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "-"
            rss = (" / ".join(f"{m:.0f}" for m in s["peak_rss_mib"])
                   if s["peak_rss_mib"] else "-")
            extra = ", ".join(f"{k} {v}" for k, v in s["extra"].items()) or ""
            rows.append(f"| {impl} | {s['median_step_s'] * 1e3:.1f} | {rounds} | {ratio} | "
                        f"{rss} | {extra} |")
        if "limits" in record:
            rows += ["", *(f"    {line}" for line in format_limits(record["limits"]))]
        parts.append("\n".join([f"### {record['bench']}: {record['description']}", "",
                                _settings_line(record) + f"; ratio: median step / "
                                f"{record['baseline']}'s", "", *rows]))
    return "\n\n".join(parts) + "\n"


def load(path: str | Path) -> dict:
    """A saved record, checked to be one (a clear error naming the file otherwise)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read benchmark record {path}: {exc}") from None
    missing = [k for k in ("bench", "description", "settings", "baseline", "impls")
               if not isinstance(record, dict) or k not in record]
    if missing:
        raise ValueError(f"{path} is not a benchmark record (missing {', '.join(missing)})")
    return record


# Records of several figures per implementation (rpc): ``figures`` maps a figure to its
# ``label``, ``unit``, ``higher_is_better`` and ``bar`` (for ours / the baseline); each
# implementation has ``figures`` (medians over rounds), ``round_figures`` and ``ratio``.


def _figure_cells(record: dict, key: str) -> list[str]:
    cells = []
    for s in record["impls"].values():
        cell = f"{s['figures'][key]:.2f}"
        if s["ratio"] is not None and s is not record["impls"].get(record["baseline"]):
            cell += f" ({s['ratio'][key]:.2f}x)"
        cells.append(cell)
    return cells


def _figures_table(record: dict) -> str:
    names = list(record["impls"])
    lines = [f"{record['bench']}: {record['description']}", _settings_line(record),
             f"{'figure':<38}" + "".join(f"{n:>22}" for n in names) + "  bar"]
    for key, fig in record["figures"].items():
        label = f"{fig['label']} ({fig['unit']})"
        bar = fig["bar"]
        bar_text = "" if bar is None else f"{'>=' if fig['higher_is_better'] else '<='}{bar:g}"
        lines.append(f"{label:<38}" + "".join(f"{c:>22}" for c in _figure_cells(record, key))
                     + f"  {bar_text}")
    lines.append(f"medians over rounds; (Nx): ours / {record['baseline']}'s")
    return "\n".join(lines)


def _figures_markdown(record: dict) -> str:
    names = list(record["impls"])
    rows = ["| figure | " + " | ".join(names) + " | bar |",
            "|---" * (len(names) + 2) + "|"]
    for key, fig in record["figures"].items():
        bar = fig["bar"]
        bar_text = "" if bar is None else f"{'>=' if fig['higher_is_better'] else '<='}{bar:g}"
        rows.append(f"| {fig['label']} ({fig['unit']}) | "
                    + " | ".join(_figure_cells(record, key)) + f" | {bar_text} |")
    return "\n".join([f"### {record['bench']}: {record['description']}", "",
                      _settings_line(record) + f"; medians over rounds; (Nx): ours / "
                      f"{record['baseline']}'s", "", *rows])


def _plot_figures(record: dict, path: str | Path, plt) -> None:
    figures = record["figures"]
    names = list(record["impls"])
    fig, axes = plt.subplots(1, len(figures), squeeze=False,
                             figsize=(PLOT_SIZE_PX[0] / _DPI, PLOT_SIZE_PX[1] / _DPI), dpi=_DPI)
    colors = ["tab:blue" if n.startswith("shardwise") else "tab:orange" for n in names]
    for ax, (key, meta) in zip(axes[0], figures.items()):
        _panel(ax, names, colors, [record["impls"][n]["figures"][key] for n in names],
               [record["impls"][n]["round_figures"][key] for n in names], meta["unit"])
        better = "higher" if meta["higher_is_better"] else "lower"
        ax.set_title(f"{meta['label']}\n({better} is better)", fontsize=8)
        ax.set_xlabel("")
    fig.suptitle(f"shardwise bench {record['bench']}: {record['settings'].get('rounds', 1)} "
                 "round(s), medians with each round")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color="tab:blue", label="shardwise"),
                        Patch(color="tab:orange", label="torch"),
                        Line2D([], [], marker="o", color="black", linestyle="",
                               label="each round"),
                        Line2D([], [], color="black", label="spread across rounds (min-max)")],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
