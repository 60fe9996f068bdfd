"""The local launcher: N ranks of one command on this machine, no cluster needed.

The launcher hosts the rendezvous TCPStore itself on a port the OS picks (so two launches never
race for a port) and tells the ranks so through ``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's
agent does; scripts that call ``torch.distributed.init_process_group`` themselves work unchanged.
Each rank's output is relayed with ``[rankN]:`` in front. When one rank fails, the others are
stopped at once and the launcher exits with that rank's code, repeating its traceback.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

import torch.distributed as dist

from shardwise.distributed.env import AGENT_STORE_VAR
from shardwise.distributed.output import PrefixedRelay, last_traceback

LOCALHOST = "127.0.0.1"
STOP_GRACE_SECONDS = 5.0


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    relays: list[PrefixedRelay]


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``argv`` as ``nproc`` ranks and return the job's exit code (0 when all succeed)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if not argv:
        raise ValueError("launch needs a command to run")
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    store = dist.TCPStore(LOCALHOST, 0, nproc, is_master=True, wait_for_workers=False)
    lock = threading.Lock()
    ranks = [_start(r, nproc, store.port, argv, env, stdout, stderr, lock) for r in range(nproc)]
    try:
        failed = _watch(ranks)
    except KeyboardInterrupt:
        _stop(ranks)
        return 130
    finally:
        _stop(ranks)
        for rank in ranks:
            for relay in rank.relays:
                relay.join(timeout=5)
    if failed is None:
        return 0
    _report(failed, stderr, lock)
    return _exit_code(failed.proc.returncode)


def rank_env(rank: int, nproc: int, port: int, base: Mapping[str, str] | None) -> dict[str, str]:
    """The environment torchrun would give rank ``rank`` of ``nproc`` on one node."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", MASTER_ADDR=LOCALHOST, MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    env[AGENT_STORE_VAR] = "True"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _start(rank, nproc, port, argv, env, stdout, stderr, lock) -> _Rank:
    proc = subprocess.Popen(
        list(argv), env=rank_env(rank, nproc, port, env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    prefix = f"[rank{rank}]: "
    relays = [
        PrefixedRelay(os.dup(proc.stdout.fileno()), prefix, stdout, lock),
        PrefixedRelay(os.dup(proc.stderr.fileno()), prefix, stderr, lock),
    ]
    proc.stdout.close()
    proc.stderr.close()
    for relay in relays:
        relay.start()
    return _Rank(rank, proc, relays)


def _watch(ranks: list[_Rank]) -> _Rank | None:
    """Wait until all ranks succeed (None) or one fails: the first to exit non-zero.

    A thread per rank waits for its process and reports the exit as it happens, so exits are
    seen in the order they occur. That order matters: when one rank dies, its peers fail moments
    later in their collectives ("connection closed by peer"), and the rank to report is the one
    that died first, with its own traceback, not the lowest-numbered of those that failed.
    """
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank in ranks:
        threading.Thread(target=lambda r=rank: exits.put((r.rank, r.proc.wait())),
                         daemon=True, name=f"shardwise-wait-rank{rank.rank}").start()
    for _ in ranks:
        index, code = _next_exit(exits)
        if code != 0:
            return ranks[index]
    return None


def _next_exit(exits: queue.Queue) -> tuple[int, int]:
    while True:  # a timeout, so that Ctrl-C reaches the main thread promptly
        with contextlib.suppress(queue.Empty):
            return exits.get(timeout=0.5)


def _stop(ranks: list[_Rank]) -> None:
    """SIGTERM every live rank's process group, then SIGKILL what is left after a grace period."""
    live = [r for r in ranks if r.proc.poll() is None]
    for rank in live:
        _signal_group(rank.proc, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for rank in live:
        try:
            rank.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(rank.proc, signal.SIGKILL)
            rank.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _report(failed: _Rank, stderr: TextIO, lock: threading.Lock) -> None:
    code = failed.proc.returncode
    how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    lines = list(failed.relays[1].tail)
    with lock:
        stderr.write(
            f"\nshardwise: rank {failed.rank} failed ({how}); the other ranks were stopped.\n"
            f"rank {failed.rank}'s error:\n{last_traceback(lines)}\n"
        )
        stderr.flush()


def _exit_code(returncode: int) -> int:
    return returncode if returncode > 0 else 128 + (-returncode)
