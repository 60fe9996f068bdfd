"""How the launcher starts a rank: ``python -m shardwise.launch.bootstrap [-m] TARGET ...``.

It runs TARGET (a script path, or a module with ``-m``) as ``__main__`` with the remaining
arguments, as ``python`` would, after setting up what the launcher relies on:

* the lifeline (the rank exits when the launcher dies, lifeline.py), unless rank_boot.py, which
  the launcher runs first, armed it already (before shardwise and torch were imported);
* a stack dump of every thread on ``SIGUSR1`` (faulthandler), which the watchdog asks for before
  it stops a rank that hangs, so the report can say where it was;
* the heartbeat that publishes this rank's progress record in the launcher's store (progress.py);
* a failure record: an exception that escapes TARGET is printed as usual, written to
  ``$TORCHELASTIC_ERROR_FILE`` (errors.py; with the ranks that never reached the collective, when
  it is a timeout), and the rank exits with status 1.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import os
import runpy
import signal
import sys
import traceback
from datetime import timedelta

from shardwise.distributed.env import flag_var, int_var, is_set, str_var
from shardwise.distributed.timeouts import default_timeout
from shardwise.launch import errors, job_secret, lifeline, progress

# the heartbeat's store client gives up a call after this long (or the job's timeout, if shorter)
_STORE_CALL_CAP = 30.0
USAGE = "usage: python -m shardwise.launch.bootstrap [-m] TARGET [ARGS...]"


def main(argv: list[str]) -> int:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    lifeline.install()
    # ignored first, so that a dump asked for during interpreter teardown (when faulthandler
    # has restored the previous handler) does not kill the rank
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    heartbeat = _start_heartbeat()
    sys.argv = list(argv)
    try:
        if module:
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc, heartbeat)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then reported
        exc.__traceback__ = _user_frames(exc.__traceback__)
        traceback.print_exception(exc)
        _record(exc, heartbeat)
        return 1
    finally:  # the heartbeat goes on through teardown (atexit): the rank is alive until it exits
        sys.stdout.flush()
        sys.stderr.flush()
        _free_the_script()
    return 0


def _free_the_script() -> None:
    """Collect what only the script's namespace still holds, while the interpreter is whole.

    runpy's namespace lives on in reference cycles (its functions' ``__globals__``), and with
    it whatever the script left there: process groups (their gloo worker threads), tensors
    those threads still reference. Freed only during the interpreter's finalization, a worker
    thread that drops the last reference to a tensor then needs the GIL, which a finalizing
    interpreter no longer grants: the process aborts ("terminate called without an active
    exception") after the script succeeded. Objects the script's exit handlers use stay
    reachable from those handlers and are kept."""
    gc.collect()


def _user_frames(tb):
    """``tb`` without its leading frames in this file and in runpy: the user's frames only."""
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
            or tb.tb_frame.f_code.co_filename.endswith("runpy.py")):
        tb = tb.tb_next
    return tb


def _exit_status(exc: SystemExit, heartbeat) -> int:
    if exc.code is None or exc.code == 0:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message"), as python does
    _record(exc, heartbeat)
    return 1


def _record(exc: BaseException, heartbeat) -> None:
    rank = int_var("RANK", default=0, minimum=0)
    waiting_for = []
    if heartbeat is not None and errors.is_timeout(exc):  # only then are the others' records
        # settled enough to compare: a rank that never arrived has been still for the timeout
        waiting_for = heartbeat.stragglers()
    try:
        errors.write_record(errors.failure_of(exc, rank, waiting_for))
    except OSError as err:
        print(f"shardwise: rank {rank} could not write its failure record: {err}", file=sys.stderr)


def _start_heartbeat() -> progress.Heartbeat | None:
    """Publish progress records when the launcher hosts the store and handed this rank the
    job's secret to sign them with (else None)."""
    secret = job_secret.of_rank()
    if secret is None or not (flag_var("TORCHELASTIC_USE_AGENT_STORE")
                              and is_set("MASTER_PORT")):
        return None
    import torch.distributed as dist

    timeout = default_timeout().total_seconds()
    try:
        store = dist.TCPStore(str_var("MASTER_ADDR", "127.0.0.1"),
                              int_var("MASTER_PORT", minimum=1, maximum=65535), is_master=False,
                              timeout=timedelta(seconds=min(timeout, _STORE_CALL_CAP)))
    except (RuntimeError, dist.DistError) as exc:
        print(f"shardwise: no progress records (store unreachable: {exc})", file=sys.stderr)
        return None
    heartbeat = progress.Heartbeat(
        store, int_var("TORCHELASTIC_RESTART_COUNT", default=0, minimum=0),
        int_var("RANK", minimum=0), int_var("WORLD_SIZE", minimum=1),
        interval=min(1.0, timeout / 5), secret=secret, pipe_fd=_progress_pipe(),
        scope=progress.scope_of(str_var(progress.ATTEMPT_VAR, "")))
    heartbeat.publish()
    heartbeat.start()
    # registered before the script runs, so it runs after the script's own exit handlers: the
    # rank beats through its teardown, and the thread is stopped before the interpreter's C++
    # objects go (a store call racing their destructors aborts the process: "terminate called
    # without an active exception")
    atexit.register(_stop_heartbeat, heartbeat)
    return heartbeat


def _progress_pipe() -> int | None:
    """The write end of this rank's pipe to its launcher, when the launcher made one."""
    fd = int_var(progress.PIPE_VAR, -1, minimum=-1)
    return None if fd < 0 else fd


def _stop_heartbeat(heartbeat: progress.Heartbeat) -> None:
    heartbeat.stop()
    # a record being written finishes or fails within the store client's timeout; a thread
    # left inside that call when the interpreter finalizes would abort the process
    heartbeat.join(timeout=_STORE_CALL_CAP + 5.0)
    if not heartbeat.is_alive():  # a last record: the teardown that follows may be slow
        with contextlib.suppress(RuntimeError, OSError):
            heartbeat.publish(exiting=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
