"""`shardwise bench NAME [options]`, `shardwise bench --render-md RECORD.json ...` and
`shardwise bench --render-page` (docs/benchmarks.md from docs/records/, page.py).

``--device cuda`` on a host without a CUDA device prints one line saying so and exits 2 before
anything else is imported or started."""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from shardwise.bench import BENCHES
from shardwise.bench.records import format_table, load, render_markdown, run_meta, save

USAGE = ("usage: shardwise bench NAME [--device cpu|cuda] [--nproc N] [--rounds R] [--out DIR]"
         " ...  (NAME --help for a benchmark's options)\n"
         "       shardwise bench --render-md RECORD.json [RECORD.json ...]\n"
         "       shardwise bench --render-page [--records DIR] [--check] [PAGE.md]")
NO_CUDA = "shardwise bench: no CUDA device is present (--device cuda needs one); nothing was run"
CUDA_BENCHES = ("ddp", "zero", "fsdp", "mesh", "tp")


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\nbenchmarks: {', '.join(BENCHES)}")
        return 0 if argv else 2
    if argv[0] == "--render-md":
        return _render(argv[1:])
    if argv[0] == "--render-page":
        from shardwise.bench.page import main as page_main

        return page_main(argv[1:])
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"shardwise bench: error: unknown benchmark {name!r}; known: "
              f"{', '.join(BENCHES)}", file=sys.stderr)
        return 2
    if _flag(rest, "--device") == "cuda" and "--worker" not in rest:
        problem = _cuda_problem(name)
        if problem:
            print(problem, file=sys.stderr)
            return 2
    out = _flag(rest, "--out")
    problem = writable_problem(out) if out and "--worker" not in rest else None
    if problem:
        print(f"shardwise bench: error: --out {problem}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[name])
    meta = run_meta(_flag(rest, "--device") or "cpu") if "--worker" not in rest else {}
    if hasattr(module, "BENCH"):
        from shardwise.bench.sidebyside import run

        record = run(module.BENCH, rest)
    else:
        record = module.run(rest)
    if record is None:  # a worker rank
        return 0
    record.setdefault("meta", {**meta, "load_after": run_meta()["load_before"]})
    record["meta"]["command"] = command_line(name, rest)
    print(format_table(record))
    if out:
        path, png = save(record, out)
        print(f"wrote {path}" + (f" and {png}" if png else " (no plot: matplotlib is missing)"))
    return 1 if record.get("failed") else 0


def command_line(name: str, argv: list[str]) -> str:
    """The command that repeats this run (``--out DIR`` left out)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return " ".join(["shardwise bench", name, *kept])


def _cuda_problem(name: str) -> str | None:
    """Why ``NAME --device cuda`` cannot run here (one line), or None."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return NO_CUDA
    if name not in CUDA_BENCHES:
        return (f"shardwise bench: error: {name} has no --device cuda variant; "
                f"these have: {', '.join(CUDA_BENCHES)}")
    return None


def writable_problem(directory: str | Path) -> str | None:
    """Why ``directory`` cannot take output files (made if missing), or None."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        return f"{directory} is not writable ({exc.strerror or exc})"
    return None


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` (``--out DIR`` or ``--out=DIR``) in ``argv``, or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _render(paths: list[str]) -> int:
    if not paths:
        print("shardwise bench: error: --render-md needs one or more record files",
              file=sys.stderr)
        return 2
    try:
        records = [load(p) for p in paths]
    except ValueError as exc:
        print(f"shardwise bench: error: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(records), end="")
    return 0
