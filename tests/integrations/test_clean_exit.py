"""An interpreter that imported shardwise, or trained with it on 2 ranks, exits once its script
ends: no non-daemon thread, exit handler, store or shared segment holds it. Each program
(exit_programs.py) runs 5 times as a real ``python`` process (subprocess: interpreter exit is
what is tested). A hang check, not a timing assertion: a process still alive 30 s after its
last line fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("exit_programs.py")
RUNS = 5
HELD_S = 30.0  # alive this long after its last line: held
RUN_S = 300.0  # the bound on reaching the last line at all


def _env(extra: dict | None = None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **(extra or {}))


def _end_seen(proc: subprocess.Popen, seen: list, lines: list) -> None:
    """Records (when, CPU seconds the program had used) at its ``END <cpu>`` line."""
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("END "):
            seen.append((time.monotonic(), float(line.split()[1])))


def exit_delays(kind: str, ranks: int) -> list[tuple[float, float]]:
    """Start ``ranks`` processes of ``kind``; for each, the wall-clock seconds from its END
    line to its exit, and the CPU seconds it used in that time (its own, from the kernel's
    accounting: on a busy machine the wall time also counts waiting for a core)."""
    import torch.distributed as dist

    store = env = None
    if ranks > 1:  # the ranks join a store this process hosts on a port the kernel picks
        store = dist.TCPStore("127.0.0.1", 0, ranks + 1, is_master=True,
                              timeout=timedelta(seconds=RUN_S), wait_for_workers=False)
        env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), TORCHELASTIC_USE_AGENT_STORE="True",
                   GLOO_SOCKET_IFNAME="lo")
    procs, readers, ends, outs = [], [], [], []
    for r in range(ranks):
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r)) if env else None
        proc = subprocess.Popen([sys.executable, str(PROGRAM), kind], env=_env(rank_env),
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        ends.append([])
        outs.append([])
        readers.append(threading.Thread(target=_end_seen, args=(proc, ends[-1], outs[-1]),
                                        daemon=True))
        readers[-1].start()
        procs.append(proc)
    try:
        return [_delay(proc, reader, end, out)
                for proc, reader, end, out in zip(procs, readers, ends, outs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        del store


def _delay(proc: subprocess.Popen, reader: threading.Thread, end: list,
           out: list) -> tuple[float, float]:
    deadline = time.monotonic() + RUN_S
    while not end and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for the line (a bounded wait, not an ordering)
    if not end:
        proc.kill()
        reader.join(5)
        pytest.fail(f"the program never printed END (exit code {proc.poll()}):\n{''.join(out)}")
    deadline = time.monotonic() + HELD_S
    while True:  # wait4: the exit, and the CPU time the process used in all
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the process was still alive {HELD_S:.0f} s after its last line")
        time.sleep(0.005)
    exited = time.monotonic()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(5)
    assert proc.returncode == 0, "".join(out)
    when, cpu = end[0]
    return exited - when, usage.ru_utime + usage.ru_stime - cpu


@pytest.mark.slow  # 5 fresh interpreters importing torch: tens of seconds on a busy machine
def test_an_interpreter_that_imported_shardwise_exits():
    for _ in range(RUNS):
        exit_delays("import", 1)


@pytest.mark.slow
def test_two_ranks_that_trained_with_shardwise_ddp_exit():
    for _ in range(RUNS):
        exit_delays("ddp", 2)


@pytest.mark.slow
def test_two_ranks_of_accelerate_ddp_with_shardwise_imported_exit():
    pytest.importorskip("accelerate", reason="accelerate is not installed "
                        "(pip install 'shardwise[accelerate]')")
    for _ in range(RUNS):
        exit_delays("accelerate", 2)


if __name__ == "__main__":  # measure: python -m tests.integrations.test_clean_exit KIND RANKS N
    kind, n_ranks, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    runs = [d for _ in range(n) for d in exit_delays(kind, n_ranks)]
    for name, values in zip(("wall", "cpu"), zip(*runs)):
        print(kind, name, "seconds from END to exit:", " ".join(f"{v:.3f}" for v in values))
        print(f"  max {max(values):.3f} median {sorted(values)[len(values) // 2]:.3f}")
