"""`shardwise train`, `run`, `plan`, `bench`, `plot` and `checkpoint`.

``shardwise train`` started by hand validates its arguments, then starts ``--nproc`` local ranks
of itself through the launcher. Started by a launcher (ours or torchrun: RANK and WORLD_SIZE are
set), it is one rank: it joins the process group and trains.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn

from shardwise.cli.launch_args import (
    add_launch_args,
    check_launch_args,
    run_launcher,
    target_problem,
)
from shardwise.cli.ranges import COUNT, Parser, bench_problem, ranks_problem
from shardwise.cli.train_args import (
    ConfigError,
    TrainConfig,
    build_parser,
    check_arguments,
    check_files,
    config_from_args,
)
from shardwise.cli.train_plan import plan_line
from shardwise.distributed.env import EnvError, launched


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except EnvError as exc:  # a variable read on the way: one line naming it
        prog = " ".join(["shardwise", *(a for a in argv[:1] if not a.startswith("-"))])
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # its own parsing: each benchmark has its own options
        from shardwise.bench.main import main as bench_main

        problem = bench_problem(argv[2:]) if len(argv) > 1 else None
        if problem:
            print(f"shardwise bench: error: {problem}", file=sys.stderr)
            return 2
        return bench_main(argv[1:])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown(parser, args.command, extra)
    if args.command == "train":
        return _train(parser, args, argv)
    if args.command == "plan":
        return _plan(parser, args)
    if args.command == "plot":
        return _plot(parser, args)

    if args.command == "checkpoint":
        from shardwise.cli.checkpoint_cmd import main as checkpoint_main

        return checkpoint_main(parser, args)
    return _run(parser, args)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardwise", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = build_parser(sub.add_parser("train", help="train the demo GPT on the stdlib corpus"))
    add_launch_args(train)
    run = sub.add_parser("run", help="run a script as N ranks per node (like torchrun)")
    run.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=COUNT,
                     default=TrainConfig.nproc, help="ranks to start on this node")
    add_launch_args(run)
    run.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m")
    run.add_argument("script", help="the script (or module with -m) to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    from shardwise.cli.plan_args import build_parser as plan_parser

    plan_parser(sub.add_parser("plan", help="memory per rank of each strategy, before a run"))
    plot = sub.add_parser("plot", help="several --log-dir runs' loss curves on one chart")
    plot.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="shardwise train --log-dir")
    plot.add_argument("--out", default="loss_curves.png", help="the PNG to write")
    plot.add_argument("--title", default="training loss", help="the chart's title")
    bench = sub.add_parser("bench", add_help=False,
                           help="ours and torch's side by side: table, JSON record, PNG plot")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="NAME [options], or --render-md RECORD.json ...")
    from shardwise.cli.checkpoint_cmd import build_parser as checkpoint_parser

    checkpoint_parser(sub.add_parser("checkpoint", help="export or inspect a checkpoint"))
    return parser


def _unknown(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> NoReturn:
    """Refuse unknown arguments as the subcommand (``shardwise train: error: ...``), naming
    the flag that was probably meant (a long flag is never taken from a prefix of it)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command_parser = sub.choices[command]
    flags = [f for a in command_parser._actions for f in a.option_strings if f.startswith("--")]
    near = [m for x in extra if x.startswith("--")
            for m in difflib.get_close_matches(x.split("=")[0], flags, n=1)]
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    command_parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _train(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    cfg = config_from_args(args)
    if launched():
        from shardwise.cli.rank_main import train_rank

        return train_rank(cfg)
    problem = check_launch_args(args)
    if problem:
        parser.exit(2, f"shardwise train: error: {problem}\n")
    try:
        check_arguments(cfg, cfg.nproc * args.nnodes, args.nnodes)
        print(plan_line(cfg, args.nnodes), flush=True)  # at once: what follows takes seconds
        check_files(cfg, cfg.nproc * args.nnodes)
    except ConfigError as exc:
        parser.exit(2, f"shardwise train: error: {exc}\n")
    from shardwise.launch.launcher import python_command  # (imports torch)

    return run_launcher("shardwise train", cfg.nproc,
                        python_command("shardwise", argv, module=True), args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from shardwise.launch.launcher import python_command

    if args.nproc < 1:
        parser.exit(2, f"shardwise run: error: --nproc must be at least 1, got {args.nproc}\n")
    problem = (ranks_problem(args.nproc) or check_launch_args(args)
               or target_problem(args.script, args.module))
    if problem:
        parser.exit(2, f"shardwise run: error: {problem}\n")
    return run_launcher("shardwise run", args.nproc,
                        python_command(args.script, args.script_args, module=args.module), args)


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from shardwise.cli.plan import plan

    try:
        print(plan(args))
    except ValueError as exc:
        parser.exit(2, f"shardwise plan: error: {exc}\n")
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathlib import Path

    from shardwise.bench.main import writable_problem
    from shardwise.cli.curves import MetricsError, draw_loss_curves, read_metrics

    runs = {}
    for directory in args.log_dirs:
        name = Path(directory).resolve().name
        if name in runs:  # two runs of one name: tell them apart by their path
            name = directory
        try:
            runs[name] = read_metrics(directory)
        except MetricsError as exc:
            parser.exit(2, f"shardwise plot: error: {exc}\n")
    problem = writable_problem(Path(args.out).resolve().parent)
    if problem:
        parser.exit(2, f"shardwise plot: error: --out: {problem}\n")
    draw_loss_curves(runs, args.out, title=args.title)
    print(f"wrote {args.out} ({len(runs)} runs)")
    return 0
