"""The command line's limits: every number a flag takes is checked against one range here.

A bad value is one line, ``shardwise <cmd>: error: ...`` with exit code 2, printed by the
launching process before any rank starts: the ``type=`` functions below raise argparse's
``ArgumentTypeError`` naming the range, and :class:`Parser` prints argparse's errors without
the usage block. The limits are generous but finite: counts up to ``MAX_COUNT``, seeds as
``torch.manual_seed`` takes them, rates finite and positive, ranks as many as this machine can
start (:func:`max_local_ranks`), at most ``MAX_LAYERS`` layers, and (checked by `train`) a
model whose training state and activations fit this machine's memory (:func:`physical_memory`).
``shardwise bench NAME`` parses its own flags, but the benchmarks may not import the CLI, so the
command checks their numbers first with :func:`bench_parser`.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import resource
from collections.abc import Callable
from typing import NoReturn

MAX_COUNT = 10**9  # steps, batches, widths, ...: far beyond any run, still finite
MAX_LAYERS = 1024  # a module per layer is built (the largest models have about 128 layers)
MAX_SEED = 2**63 - 1  # torch.manual_seed's largest non-negative seed
MAX_LR = 1e3
RANKS_PER_CORE = 16
MIN_RANK_LIMIT = 32  # a small machine still runs every test's and example's world size


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each flag's line with its default, ``(default: X)``, where it has one
    worth showing (not None, not an off switch, not an empty list); choices show in the flag's
    metavar, ``{a,b}``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = (default not in (None, argparse.SUPPRESS, (), [])
                 and not isinstance(default, bool) and action.option_strings
                 and "%(default)" not in text)
        return f"{text} (default: %(default)s)".lstrip() if shown else text

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, tuple) and action.default:
            action = copy.copy(action)
            action.default = ",".join(map(str, action.default))  # as the flag is written
        return super()._expand_help(action)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line: ``PROG: error: MESSAGE``, exit code 2; a
    range error reads ``--flag must be ...`` rather than ``argument --flag: must be ...``. Its
    help shows every flag's default (:class:`DefaultsFormatter`), and a long flag is taken
    only as written: ``--step 2`` is an error, not ``--steps 2`` (``allow_abbrev=False``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        flag, sep, rest = message.removeprefix("argument ").partition(": ")
        if message.startswith("argument ") and sep and rest.startswith("must be"):
            message = f"{flag} {rest}"
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_arg(lo: int, hi: int, note: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``lo .. hi`` (``note`` says why ``hi``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r:.40}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {_short(value)}")
        if value > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi}{note}, got {_short(value)}")
        return value

    parse.__name__ = "integer"
    return parse


def float_arg(lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number in ``lo .. hi`` (``above``: greater than lo)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r:.40}") from None
        low_ok = value > lo if above else value >= lo
        if not (math.isfinite(value) and low_ok and value <= hi):
            bound = f"greater than {_num(lo)}" if above else f"at least {_num(lo)}"
            raise argparse.ArgumentTypeError(
                f"must be a finite number {bound} and at most {_num(hi)}, got {text!r:.40}")
        return value

    parse.__name__ = "number"
    return parse


COUNT = int_arg(1, MAX_COUNT)  # at least one
COUNT0 = int_arg(0, MAX_COUNT)  # zero allowed (zero means "off" or "all")
LAYERS = int_arg(1, MAX_LAYERS)
SEED = int_arg(0, MAX_SEED, " (2**63 - 1, as torch.manual_seed takes it)")
LR = float_arg(0.0, MAX_LR, above=True)


def max_local_ranks() -> int:
    """The most ranks one launcher starts on this machine: ``RANKS_PER_CORE`` per CPU core (at
    least ``MIN_RANK_LIMIT``), and no more than a quarter of the processes this user may run
    (RLIMIT_NPROC; each rank runs several threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = max(MIN_RANK_LIMIT, RANKS_PER_CORE * (cores or 1))
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, max(1, soft // 4))
    return limit


def ranks_problem(nproc: int) -> str | None:
    """Why ``--nproc`` local ranks cannot be started here, or None."""
    limit = max_local_ranks()
    if nproc > limit:
        return (f"--nproc {nproc} is more ranks than this machine can start: at most {limit} "
                f"({RANKS_PER_CORE} per CPU core, within the user's process limit)")
    return None


def physical_memory() -> int:
    """Bytes of memory of this machine (cgroup limits aside)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _num(value: float) -> str:
    """``value`` without an exponent where it is a whole number below 10**16."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e16 else f"{value:g}"


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def bench_parser() -> Parser:
    """The numeric flags of ``shardwise bench NAME`` (each benchmark parses its own; these are
    checked first so that an extreme value is one line, not a traceback per rank)."""
    parser = Parser(prog="shardwise bench", add_help=False, allow_abbrev=False)
    add = parser.add_argument
    for flag in ("--nproc", "--rounds", "--steps", "--iters", "--echo", "--big", "--inflight",
                 "--microbatches", "--replicas", "--n-head"):
        add(flag, type=COUNT)
    add("--warmup", type=COUNT0)
    add("--n-layer", type=LAYERS)
    for flag in ("--d-model", "--hidden"):
        add(flag, type=int_arg(1, 2**16))
    for flag in ("--seq-len", "--batch-size", "--tokens"):
        add(flag, type=int_arg(1, 2**20))
    for flag in ("--mib", "--big-mb"):  # MiB (MB): up to 64 Gi
        add(flag, type=int_arg(1, 2**16))
    add("--bucket-cap-mb", type=float_arg(0.0, 2.0**16, above=True))
    return parser


def bench_problem(argv: list[str]) -> str | None:
    """Why ``shardwise bench`` arguments ``argv`` (after the name) cannot run, or None; a bad
    number exits through :func:`bench_parser` (one line, exit code 2)."""
    args, _ = bench_parser().parse_known_args(argv)
    return ranks_problem(args.nproc) if args.nproc is not None else None
