"""The test harness itself: each way it starts a process, and the reset between pooled tests."""

from __future__ import annotations

import os
import warnings

import pytest

from tests.harness import procs, run_on_ranks


def _warn_once_in_rank(ctx) -> list[str]:
    from shardwise.fsdp.fsdp1 import args as fsdp1_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            fsdp1_args.warn_once("harness-check", "harness check: warned once per test")
    return [str(w.message) for w in caught]


@pytest.mark.fresh
@pytest.mark.parametrize("turn", ["first", "later"])
def test_a_warn_once_warning_fires_again_in_a_later_pooled_test(turn):
    # the same pooled rank runs both turns: without the harness's reset before each body, the
    # later turn would find the mark of the first and warn nothing
    assert run_on_ranks(1, _warn_once_in_rank) == [["harness check: warned once per test"]]


def test_the_test_process_resets_warn_once_marks_before_each_test():
    # (the autouse fixture of tests/conftest.py ran before this test, after the one above)
    assert [*_warn_once_in_rank(None)] == ["harness check: warned once per test"]


_PROGRAM = """
import atexit, os, sys
atexit.register(print, "exit handler ran")
print("argv", sys.argv[1:], "env", os.environ["HARNESS_CHECK"], "cwd", os.getcwd())
print("on stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.fresh
def test_a_program_gets_its_argv_env_cwd_exit_code_and_exit_handlers(tmp_path):
    done = procs.run(["-c", _PROGRAM, "a", "b"], dict(os.environ, HARNESS_CHECK="yes"),
                     cwd=tmp_path, timeout=60)
    assert done.returncode == 3, done
    assert done.stdout.splitlines() == [
        f"argv ['a', 'b'] env yes cwd {tmp_path}", "exit handler ran"], done
    assert done.stderr == "on stderr\n"
    assert "HARNESS_CHECK" not in os.environ


@pytest.mark.fresh
def test_a_program_streams_its_output_while_it_runs():
    program = procs.start(["-c", "import time; print('line', flush=True); time.sleep(60)"],
                          dict(os.environ), streams=True)
    try:
        assert program.stdout.readline() == "line\n"  # before the program ends
        assert program.poll() is None
    finally:
        program.kill()
        program.stdout.close()
    assert program.wait(30) == -9


def test_fresh_processes_do_not_hold_the_preloaded_modules():
    held = procs.run(["-c", "import sys; print('torch' in sys.modules)"], dict(os.environ),
                     timeout=120).stdout.strip()
    assert held == ("False" if procs.fresh() else "True")
