"""The launcher's flags, shared by `shardwise run` and `shardwise train` (torchrun's names)."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shardwise.cli.env_check import env_problem
from shardwise.cli.ranges import COUNT0, float_arg, int_arg
from shardwise.distributed.env import int_var, is_set, launched, str_var
from shardwise.distributed.timeouts import default_timeout
from shardwise.launch.preemption import DEFAULT_GRACE_SECONDS

GRACE = float_arg(0.0, 24 * 3600.0, above=True)
NODES = int_arg(1, 2**16)


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--max-restarts", type=COUNT0, default=0,
        help="restart every rank after a failure, up to this many times")
    add("--grace-seconds", type=GRACE, default=DEFAULT_GRACE_SECONDS,
        help="on SIGTERM/SIGHUP/SIGINT or a failure: how long ranks get to exit before SIGKILL")
    add("--nnodes", type=NODES, default=1, help="nodes in the job (one launcher per node)")
    add("--node-rank", type=COUNT0, default=0, help="this node's number, 0 .. nnodes-1")
    add("--rdzv-endpoint", default=None,
        help="host:port of node 0's rendezvous store (needed with --nnodes above 1)")


def check_launch_args(args: argparse.Namespace) -> str | None:
    """The first problem with the launcher's flags or the environment, or None. Sets
    ``args.rdzv_endpoint`` from MASTER_ADDR / MASTER_PORT when the flag is not given."""
    problem = env_problem() or master_from_env(args)
    if problem:
        return problem
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


def master_from_env(args: argparse.Namespace) -> str | None:
    """Honour MASTER_ADDR / MASTER_PORT set in the launcher's environment: the rendezvous store
    listens at MASTER_ADDR:MASTER_PORT (MASTER_ADDR defaults to 127.0.0.1), as if given as
    ``--rdzv-endpoint``. Not inside a job (RANK and WORLD_SIZE set): there they are the outer
    job's. Returns why they cannot be used, or None."""
    if launched() or not (is_set("MASTER_PORT") or is_set("MASTER_ADDR")):
        return None
    if not is_set("MASTER_PORT"):
        return ("MASTER_ADDR is set but MASTER_PORT is not: set both (the rendezvous store "
                "listens at MASTER_ADDR:MASTER_PORT), or pass --rdzv-endpoint host:port")
    port = int_var("MASTER_PORT", minimum=1, maximum=65535)
    host = str_var("MASTER_ADDR", "127.0.0.1").strip()
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if args.rdzv_endpoint is None:
        args.rdzv_endpoint = endpoint
    elif args.rdzv_endpoint != endpoint:
        return (f"--rdzv-endpoint {args.rdzv_endpoint} and MASTER_ADDR:MASTER_PORT ({endpoint}) "
                "disagree: unset MASTER_ADDR/MASTER_PORT or make them the same")
    return None


def endpoint_problem(args: argparse.Namespace) -> str | None:
    """With ``--nnodes`` above 1: ``--rdzv-endpoint`` must be host:port, and a node other than
    node 0 waits (up to the rendezvous timeout, ``$SHARDWISE_TIMEOUT``) until something answers
    there, so that an unreachable endpoint is one error naming it rather than a silent wait."""
    from shardwise.launch.nodes import NodeError, parse_endpoint

    endpoint = args.rdzv_endpoint
    if args.nnodes <= 1 or endpoint is None:
        return None
    try:
        host, port = parse_endpoint(endpoint)
    except NodeError as exc:
        return str(exc)
    if args.node_rank == 0:
        return None
    limit = default_timeout().total_seconds()
    deadline = time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1)):
                return None
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        if left <= 0:
            return (f"--rdzv-endpoint {endpoint}: nothing answered there within {limit:g} s "
                    f"({why}); start node 0's launcher with the same endpoint, or check the "
                    "address ($SHARDWISE_TIMEOUT sets the wait)")
        time.sleep(min(0.5, max(left, 0.0)))


def target_problem(target: str, module: bool) -> str | None:
    """Why ``shardwise run`` cannot start ``target`` (a script, or a module with ``-m``), found
    before any rank starts; the module is looked up as ``python -m`` would, not imported."""
    if module:
        return _module_problem(target)
    path = Path(target)
    if not path.exists():
        return f"script {target!r} does not exist"
    if path.is_dir():
        return f"{target!r} is a directory, not a script (a package runs with -m)"
    if not path.is_file() or not os.access(path, os.R_OK):
        return f"script {target!r} is not a readable file"
    return None


def _module_problem(name: str) -> str | None:
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return f"-m {name!r} is not a module name"
    search = [os.getcwd(), *sys.path]  # python -m looks in the working directory first
    spec = importlib.machinery.PathFinder.find_spec(parts[0], search) \
        or importlib.util.find_spec(parts[0])  # (a top-level name is found, not imported)
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            break
        spec = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[:i + 1]), list(spec.submodule_search_locations))
    else:
        if spec is not None and spec.submodule_search_locations is not None:
            main = importlib.machinery.PathFinder.find_spec(
                f"{name}.__main__", list(spec.submodule_search_locations))
            return None if main else f"-m {name}: a package without a __main__ module"
        if spec is not None:
            return None
    return f"-m {name}: no module named {name!r} (looked in the working directory and sys.path)"


def launch(nproc: int, argv: Sequence[str], **options) -> int:
    """``shardwise.launch.launch``, imported when a job starts: the launcher hosts the
    rendezvous store (c10d's TCPStore), so it is the first thing here that imports torch."""
    from shardwise.launch import launch as start

    return start(nproc, argv, **options)


def run_launcher(prog: str, nproc: int, argv: Sequence[str], args: argparse.Namespace) -> int:
    from shardwise.launch.nodes import NodeError

    problem = endpoint_problem(args)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return launch(nproc, argv, max_restarts=args.max_restarts,
                      grace_seconds=args.grace_seconds, nnodes=args.nnodes,
                      node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    except NodeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
