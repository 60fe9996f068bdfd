"""The regression gate: one benchmark for the working tree and for another revision, alternated
round by round in one run, and each row's ratio new/old with a verdict.

    python benchmarks/compare.py ddp --base f1d3865                 # 3 rounds, the bench's sizes
    python benchmarks/compare.py ddp --base HEAD --rounds 5 -- --d-model 512 --n-head 8
    python benchmarks/compare.py --smoke --base HEAD                # every benchmark, tiny sizes

REV is checked out into a temporary git worktree (removed at the end); each round runs
``python -m shardwise.bench NAME --rounds 1`` once per tree, with ``PYTHONPATH`` naming that
tree's ``src`` (its ranks inherit it), the two trees in alternating order, so that load from
elsewhere falls on both alike. For each row (an implementation's step time, or a figure of the
rpc and collectives benchmarks) a round gives one ratio, new over old, turned so that above 1
is worse whichever way the figure points. The row's ratio is the median of those. Its noise is
the largest of: ``NOISE_FLOOR``; half the spread of its rounds' ratios; and how far from 1 the
rows of torch's own implementations moved, whose code is the same in both trees (so whatever
moved them was the machine). "slower" means every round was worse and the median beyond the
noise; "faster" the same the other way; anything else is "within noise"; fewer than
``MIN_ROUNDS`` rounds give no verdict. The exit
status is 1 when a row is slower, else 0; ``--smoke`` always exits 0 unless a run failed
(CI runs it to keep every benchmark and this gate working, not to judge speed on a busy
machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOISE_FLOOR = 0.03  # a ratio within 3% of 1 is never a verdict
MIN_ROUNDS = 3  # fewer rounds say nothing about the spread
CONTROL = "torch"  # rows of implementations whose code both trees share
GPT_TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
            "--batch-size", "4", "--steps", "2", "--warmup", "1"]
TINY = {  # the smallest run of each benchmark that still runs every row
    "ddp": GPT_TINY, "zero": GPT_TINY, "fsdp": GPT_TINY, "mesh": GPT_TINY,
    "pipeline": [*GPT_TINY, "--microbatches", "2"],
    "tp": ["--d-model", "32", "--hidden", "64", "--tokens", "16", "--steps", "2",
           "--warmup", "1"],
    "rpc": ["--echo", "20", "--big", "1", "--big-mb", "1", "--inflight", "50"],
    "collectives": ["--iters", "2", "--mib", "1"],
}


class RunFailed(RuntimeError):
    """A benchmark run exited with an error; the message holds its last output."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    args = _parser().parse_args(ours)
    names = sorted(TINY) if args.smoke else [args.name]
    if not args.smoke and args.name is None:
        _parser().error("name a benchmark, or give --smoke")
    rounds = args.rounds if args.rounds is not None else (1 if args.smoke else 3)
    with tempfile.TemporaryDirectory(prefix="shardwise-compare-") as tmp:
        base = _worktree(args.base, Path(tmp) / "base")
        try:
            worse = False
            for name in names:
                extra = TINY[name] if args.smoke else bench_args
                rows = compare(name, base, rounds, extra, Path(tmp) / name)
                print(format_rows(name, args.base, rows), flush=True)
                worse |= any(row["verdict"] == "slower" for row in rows)
        except RunFailed as exc:
            print(f"compare: {exc}", file=sys.stderr)
            return 2
        finally:
            _remove_worktree(base)
    return 0 if args.smoke or not worse else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/compare.py", allow_abbrev=False,
                                     description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", choices=sorted(TINY), help="the benchmark")
    parser.add_argument("--base", default="HEAD", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per tree (default: 3; 1 with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="every benchmark at tiny sizes; never fails on a verdict")
    parser.epilog = "Options after -- go to the benchmark itself."
    return parser


def compare(name: str, base: Path, rounds: int, bench_args: list[str], out: Path) -> list[dict]:
    """Run ``name`` ``rounds`` times per tree, alternating, and the rows' verdicts."""
    records: dict[str, list[dict]] = {"new": [], "old": []}
    for i in range(rounds):
        order = ("new", "old") if i % 2 == 0 else ("old", "new")
        for tree in order:
            src = ROOT / "src" if tree == "new" else base / "src"
            records[tree].append(run_bench(name, src, bench_args, out / f"{tree}-{i}"))
    return judge(records["new"], records["old"])


def run_bench(name: str, src: Path, args: list[str], out: Path) -> dict:
    """One round of benchmark ``name`` with the shardwise under ``src``; its JSON record."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "shardwise.bench", name, "--rounds", "1", "--out", str(out),
           *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src.parent)
    records = sorted(out.glob("*.json"))
    if done.returncode != 0 or not records:
        raise RunFailed(f"{' '.join(cmd)} (PYTHONPATH={src}) exited {done.returncode}:\n"
                        f"{(done.stdout + done.stderr)[-2000:]}")
    return json.loads(records[0].read_text())


def figures_of(record: dict) -> dict[str, tuple[float, bool]]:
    """Each row's figure: ``name -> (value, higher_is_better)``."""
    out = {}
    if record.get("kind") == "figures":
        for impl, entry in record["impls"].items():
            for key, value in entry["figures"].items():
                if value is not None:
                    out[f"{impl} {key}"] = (value, record["figures"][key]["higher_is_better"])
        return out
    for impl, entry in record["impls"].items():
        out[f"{impl} step (ms)"] = (entry["median_step_s"] * 1e3, False)
        if entry.get("peak_rss_mib"):
            out[f"{impl} peak RSS (MiB)"] = (max(entry["peak_rss_mib"]), False)
    return out


def judge(new: list[dict], old: list[dict]) -> list[dict]:
    """Per row: old and new medians, the per-round ratios (above 1: worse), and the verdict."""
    new_figs, old_figs = [figures_of(r) for r in new], [figures_of(r) for r in old]
    rows = []
    for key in new_figs[0]:
        if not all(key in f for f in new_figs + old_figs):
            continue  # a row only one tree has
        higher_better = new_figs[0][key][1]
        pairs = [(n[key][0], o[key][0]) for n, o in zip(new_figs, old_figs, strict=True)]
        ratios = [(o / n if higher_better else n / o) if min(n, o) > 0 else 1.0
                  for n, o in pairs]
        rows.append({"row": key, "old": statistics.median(o for _, o in pairs),
                     "new": statistics.median(n for n, _ in pairs), "ratios": ratios,
                     "ratio": statistics.median(ratios)})
    control = max((abs(r["ratio"] - 1) for r in rows if r["row"].startswith(CONTROL)),
                  default=0.0)
    for row in rows:
        row.update(verdict(row["ratios"], control))
    return rows


def verdict(ratios: list[float], control: float = 0.0) -> dict:
    """The noise of ``ratios`` (half their spread, what moved the control rows, at least
    NOISE_FLOOR) and the verdict."""
    noise = max(NOISE_FLOOR, (max(ratios) - min(ratios)) / 2, control)
    middle = statistics.median(ratios)
    if len(ratios) < MIN_ROUNDS:
        word = f"no verdict ({len(ratios)} round{'s' if len(ratios) > 1 else ''})"
    elif middle > 1 + noise and min(ratios) > 1:
        word = "slower"
    elif middle < 1 - noise and max(ratios) < 1:
        word = "faster"
    else:
        word = "within noise"
    return {"noise": noise, "verdict": word}


def format_rows(name: str, base: str, rows: list[dict]) -> str:
    lines = [f"{name}: working tree (new) against {base} (old), alternated; ratio above 1: "
             "new is worse",
             f"{'row':<44}{'old':>12}{'new':>12}{'ratio':>8}  {'rounds':<22}{'noise':>7}  verdict"]
    for r in rows:
        rounds = " ".join(f"{x:.3f}" for x in r["ratios"])
        lines.append(f"{r['row']:<44}{r['old']:>12.4g}{r['new']:>12.4g}{r['ratio']:>8.3f}  "
                     f"{rounds:<22}{r['noise']:>7.3f}  {r['verdict']}")
    return "\n".join(lines)


def _worktree(rev: str, path: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                    str(path), rev], check=True)
    return path


def _remove_worktree(path: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                   check=False, capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
