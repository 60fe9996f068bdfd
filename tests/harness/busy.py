"""Run a command beside N CPU-bound processes: the suite on a busy machine (docs/testing.md).

    python -m tests.harness.busy 16 -- python -m pytest tests/distributed/test_launch_leavers.py

starts 16 processes that spin (``while True: pass``), prints ``uptime`` before and after, runs
the command, and ends every spinner it started (they also end on their own after
``--limit`` seconds, so none outlives a killed run). The exit status is the command's.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        with open("/proc/loadavg") as f:
            return "load average: " + ", ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.busy", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("count", type=int, help="how many spinning processes")
    parser.add_argument("--limit", type=float, default=3600.0,
                        help="seconds after which a spinner ends by itself (default 3600)")
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        parser.error("give the count, then -- and the command to run")
    cut = argv.index("--")
    args, command = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if args.count < 0 or not command:
        parser.error("give a count of at least 0, then -- and the command to run")
    spin = f"import time; end = time.monotonic() + {args.limit}\nwhile time.monotonic() < end: pass"
    # SIGTERM (a timeout, a kill by pid) ends this process through ``finally``: spinners too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.count)]
    try:
        print(f"busy: {args.count} spinners; {_uptime()}", flush=True)
        start = time.monotonic()
        code = subprocess.call(command)
        print(f"busy: command exited {code} after {time.monotonic() - start:.0f} s; "
              f"{_uptime()}", flush=True)
        return code
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
