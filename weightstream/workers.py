"""Worker threads for a load's reads and probes.

Like ``concurrent.futures.ThreadPoolExecutor`` (tasks in, ``Future`` objects out), with two differences a loader
needs. Its threads are daemon threads: an abandoned load (an iterator its caller never finished, held to the end of
the program) does not make the interpreter wait at exit for every read it had queued, and no private exit hook is
needed to stop it. And it takes tasks in any thread at any time: an executor refuses new work once the main thread
has ended, which broke loads in a thread that outlives it. Every other path ends with :meth:`WorkerPool.shutdown`,
which cancels queued tasks and joins the threads (running tasks finish first: their memory must not vanish under
them).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = None
"""What a thread finds on the queue when the pool shuts down."""


class WorkerPool:
    """At most ``threads`` daemon threads named ``<name>_<n>``, started as tasks arrive.

    Example:
        >>> pool = WorkerPool(2, "weightstream-example")
        >>> pool.submit(sum, [1, 2, 3]).result()
        6
        >>> pool.shutdown()
    """

    def __init__(self, threads: int, name: str, initializer: Callable[[], Any] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"a worker pool needs at least one thread, got {threads}")
        self._limit = threads
        self._name = name
        self._initializer = initializer
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)
        self._closed = False

    def submit(self, task: Callable[..., Any], *args: Any) -> Future:
        """Queue ``task(*args)``; its future holds the result or the exception.

        Raises:
            RuntimeError: the pool was shut down.
        """
        if self._closed:
            raise RuntimeError(f"{self._name}: the worker pool was shut down")
        future: Future = Future()
        self._tasks.put((future, task, args))
        if not self._idle.acquire(blocking=False) and len(self._threads) < self._limit:
            thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return future

    def shutdown(self) -> None:
        """Cancel the queued tasks, let running ones finish and join every thread.

        At interpreter exit (an abandoned load's generator closed while modules are torn down) the threads are
        not joined: the runtime no longer runs them, so a join would wait forever.
        """
        self._closed = True
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].cancel()
        for _ in self._threads:
            self._tasks.put(_STOP)
        if sys.is_finalizing():
            return
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        failure: BaseException | None = None
        if self._initializer is not None:
            try:
                self._initializer()
            except BaseException as error:  # noqa: BLE001 - every task this thread takes fails with it, none waits forever
                failure = error
        while (item := self._tasks.get()) is not _STOP:
            future, task, args = item
            if future.set_running_or_notify_cancel():
                try:
                    if failure is not None:
                        raise failure
                    future.set_result(task(*args))
                except BaseException as error:  # noqa: BLE001 - the future carries it to whoever waits
                    future.set_exception(error)
                del future, task, args, item  # a finished task's arguments (views of the load's memory) go now
            self._idle.release()
