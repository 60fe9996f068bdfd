"""The launcher's flags, shared by `shardwise run` and `shardwise train` (torchrun's names)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from shardwise.distributed import launch
from shardwise.distributed.launcher import DEFAULT_GRACE_SECONDS
from shardwise.distributed.nodes import NodeError


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--max-restarts", type=int, default=0,
        help="restart every rank after a failure, up to this many times")
    add("--grace-seconds", type=float, default=DEFAULT_GRACE_SECONDS,
        help="on SIGTERM/SIGHUP/SIGINT or a failure: how long ranks get to exit before SIGKILL")
    add("--nnodes", type=int, default=1, help="nodes in the job (one launcher per node)")
    add("--node-rank", type=int, default=0, help="this node's number, 0 .. nnodes-1")
    add("--rdzv-endpoint", default=None,
        help="host:port of node 0's rendezvous store (needed with --nnodes above 1)")


def check_launch_args(args: argparse.Namespace) -> str | None:
    """The first problem with the launcher's flags, or None."""
    if args.max_restarts < 0:
        return f"--max-restarts must be at least 0, got {args.max_restarts}"
    if not (math.isfinite(args.grace_seconds) and args.grace_seconds > 0):
        return f"--grace-seconds must be positive, got {args.grace_seconds}"
    if args.nnodes < 1:
        return f"--nnodes must be at least 1, got {args.nnodes}"
    if not 0 <= args.node_rank < args.nnodes:
        return (f"--node-rank must be in [0, {args.nnodes}) for --nnodes {args.nnodes}, "
                f"got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        return "--nnodes above 1 needs --rdzv-endpoint host:port (node 0's address)"
    return None


def run_launcher(prog: str, nproc: int, argv: Sequence[str], args: argparse.Namespace) -> int:
    try:
        return launch(nproc, argv, max_restarts=args.max_restarts,
                      grace_seconds=args.grace_seconds, nnodes=args.nnodes,
                      node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    except NodeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
