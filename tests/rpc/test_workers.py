"""The agent's worker pool: every task runs, blocked tasks do not hold up the rest."""

from __future__ import annotations

import threading

from shardwise.rpc.workers import WorkerPool


def test_every_task_runs():
    pool = WorkerPool(4, "test-pool")
    done, lock, all_done = [], threading.Lock(), threading.Event()

    def task(i: int) -> None:
        with lock:
            done.append(i)
            if len(done) == 500:
                all_done.set()

    for i in range(500):
        pool.submit(task, i)
    assert all_done.wait(30)
    assert sorted(done) == list(range(500))
    pool.shutdown()


def test_tasks_that_wait_for_each_other_all_run_at_once():
    pool = WorkerPool(6, "test-pool")
    barrier = threading.Barrier(6, timeout=30)
    results, lock, all_done = [], threading.Lock(), threading.Event()

    def task() -> None:
        index = barrier.wait()  # only returns once all six run at the same time
        with lock:
            results.append(index)
            if len(results) == 6:
                all_done.set()

    for _ in range(6):
        pool.submit(task)
    assert all_done.wait(30)
    assert sorted(results) == list(range(6))
    pool.shutdown()


def test_a_failing_task_does_not_stop_the_pool():
    pool = WorkerPool(1, "test-pool")
    ran = threading.Event()

    def fail() -> None:
        raise ValueError("expected in this test")

    pool.submit(fail)
    pool.submit(ran.set)
    assert ran.wait(30)
    pool.shutdown()
