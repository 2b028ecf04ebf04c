"""The worker pool under the readers: results and errors through futures, shutdown that cancels what is queued
and joins every thread, and a failing initializer that fails tasks instead of leaving them waiting."""

from __future__ import annotations

import threading

import pytest

from weightstream.workers import WorkerPool


def _threads(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(name)]


def test_tasks_run_on_at_most_the_named_threads_and_shutdown_joins_them():
    pool = WorkerPool(3, "test-pool")
    seen = set()
    futures = [pool.submit(lambda n: seen.add(threading.current_thread().name) or n * n, n) for n in range(50)]
    assert [future.result(timeout=10) for future in futures] == [n * n for n in range(50)]
    assert seen <= {"test-pool_0", "test-pool_1", "test-pool_2"}
    assert all(thread.daemon for thread in _threads("test-pool"))
    pool.shutdown()
    assert _threads("test-pool") == []


def test_shutdown_cancels_queued_tasks_and_lets_the_running_one_finish():
    pool = WorkerPool(1, "test-cancel")
    running, release, finished = threading.Event(), threading.Event(), []

    def blocking() -> str:
        running.set()
        release.wait(10)
        finished.append(True)
        return "done"

    first = pool.submit(blocking)
    queued = [pool.submit(finished.append, n) for n in range(5)]
    assert running.wait(10)
    threading.Timer(0.1, release.set).start()
    pool.shutdown()
    assert first.result(timeout=0) == "done"
    assert all(future.cancelled() for future in queued)
    assert finished == [True]
    assert _threads("test-cancel") == []
    with pytest.raises(RuntimeError, match="test-cancel: the worker pool was shut down"):
        pool.submit(finished.append, 1)


def test_an_error_travels_in_the_future():
    pool = WorkerPool(2, "test-error")
    try:
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(timeout=10)
    finally:
        pool.shutdown()
    assert _threads("test-error") == []


def test_a_failing_initializer_fails_every_task_it_takes():
    def initializer() -> None:
        raise OSError("no such device")

    pool = WorkerPool(2, "test-init", initializer)
    try:
        futures = [pool.submit(int, "1") for _ in range(4)]
        for future in futures:
            with pytest.raises(OSError, match="no such device"):
                future.result(timeout=10)
    finally:
        pool.shutdown()
    assert _threads("test-init") == []


def test_a_pool_needs_a_thread():
    with pytest.raises(ValueError, match="needs at least one thread, got 0"):
        WorkerPool(0, "test-none")
