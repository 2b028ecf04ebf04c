"""What the host and the staged readers share: reading one request, tracking which tensors wait for
which reads, and letting go of failed readers' memory (their files: :mod:`weightstream.readers.files`)."""

from __future__ import annotations

import contextlib
import queue
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from weightstream.memory.host import HostArena, view_as
from weightstream.options import LoadOptions
from weightstream.planning.plan import PAGE, FileLayout, ReadRequest, round_up_to_page
from weightstream.sources.base import Source
from weightstream.workers import WorkerPool

THREAD_NAME_PREFIX = "weightstream-read"


def wants_huge_pages(source: Source, opts: LoadOptions) -> bool:
    """Huge pages pay off for direct reads; recycled 4 KiB pages fault in faster for buffered ones."""
    return source.direct if opts.huge_pages == "auto" else opts.huge_pages


def read_request(source: Source, request: ReadRequest, view: memoryview, at: int) -> None:
    """Read ``request`` so that its first byte lands at ``view[at]``.

    Direct reads are widened to whole pages, so ``view`` must have room for the request's
    offset within its page before ``at`` (the layout and the staging slots keep it free).
    """
    if source.direct:
        head = request.offset % PAGE
        start = at - head
        source.read_into(request.offset - head, view[start : start + round_up_to_page(head + request.nbytes)])
    else:
        source.read_into(request.offset, view[at : at + request.nbytes])


def read_into_arena(
    source: Source, request: ReadRequest, arena: HostArena, stop: threading.Event, opts: LoadOptions, base: int = 0
) -> None:
    """A reader thread's task: read ``request`` to ``base`` + its place in ``arena``, unless the load stopped.

    With ``prefault`` the pages are faulted in on this thread first: an object store's transport writes
    the bytes from its one event-loop thread, which should not take the faults too.
    """
    if stop.is_set():
        return
    at = base + request.dest_offset
    if opts.prefault:
        arena.populate(at, request.nbytes)
    read_request(source, request, arena.view, at)
    if opts.progress is not None:
        opts.progress(request.nbytes)


def start_readers(
    cleanup: contextlib.ExitStack, opts: LoadOptions, name: str = THREAD_NAME_PREFIX, initializer: Any = None
) -> tuple[WorkerPool, threading.Event, dict[Future, Any]]:
    """The reader threads of one load, a stop flag and the map of their reads, registered with ``cleanup``
    so that on any exit the flag is set, queued reads are cancelled, running ones finish (their memory
    must not vanish under them) and failed readers' frames let go of the load's memory."""
    futures: dict[Future, Any] = {}
    cleanup.callback(forget_failures, futures)
    stop = threading.Event()
    readers = WorkerPool(opts.reader_threads, name, initializer)
    cleanup.callback(readers.shutdown)
    cleanup.callback(stop.set)
    return readers, stop, futures


def forget_failures(futures: Iterable[Future]) -> None:
    """Drop the locals of failed readers' frames: they hold views of the load's memory, and the
    memory of a failed load must not live as long as the caller keeps the exception."""
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is not None:
            traceback.clear_frames(future.exception().__traceback__)


def tensors_as_read(
    layouts: list[FileLayout],
    futures: dict[Future, tuple[int, int]],
    tensor_of: Callable[[int, int], tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``tensor_of(file number, tensor number)`` for each tensor as its last read completes:
    empty tensors first, then in completion order.

    ``futures`` maps each submitted read to its (file number, request number); a read's error is
    raised here.
    """
    waiting = [Waiting(layout) for layout in layouts]
    for file_number, tensors in enumerate(waiting):
        for tensor_number in tensors.ready_without_reads():
            yield tensor_of(file_number, tensor_number)
    completions = Completions()
    for future in list(futures):
        completions.add(future)
    while completions.pending:
        future = completions.next()
        future.result()
        file_number, request_number = futures.pop(future)
        for tensor_number in waiting[file_number].request_done(request_number):
            yield tensor_of(file_number, tensor_number)


class Completions:
    """Futures in the order they finish. Each puts itself on a queue when done, so taking the next one
    costs the same however many are pending: ``concurrent.futures.wait`` locks every pending future on
    every call (16 ms a call at 17k pending reads, a 140 GB checkpoint in 8 MiB requests).

    Example:
        >>> from concurrent.futures import Future
        >>> completions, future = Completions(), Future()
        >>> completions.add(future); future.set_result(7)
        >>> completions.next().result(), completions.pending
        (7, 0)
    """

    def __init__(self) -> None:
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self.pending = 0

    def add(self, future: Future) -> None:
        self.pending += 1
        future.add_done_callback(self._done.put)

    def next(self) -> Future:
        """The next future to finish (waiting for it if none has)."""
        future = self._done.get()
        self.pending -= 1
        return future


def buffer_tensor(layout: FileLayout, buffer: torch.Tensor, tensor_number: int) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` of tensor ``tensor_number`` of ``layout``, over its file's destination ``buffer``."""
    spec, offset = layout.tensor_offsets[tensor_number]
    return spec.name, view_as(buffer, offset, spec)


class Waiting:
    """Which tensors of one file still wait for which reads."""

    def __init__(self, layout: FileLayout) -> None:
        self._remaining = [len(needed) for needed in layout.tensor_requests]
        self._waiters: list[list[int]] = [[] for _ in layout.requests]
        for tensor_number, needed in enumerate(layout.tensor_requests):
            for request_number in needed:
                self._waiters[request_number].append(tensor_number)

    def ready_without_reads(self) -> list[int]:
        """Tensors with no bytes to read (empty ones)."""
        return [number for number, count in enumerate(self._remaining) if count == 0]

    def request_done(self, request_number: int) -> list[int]:
        """Tensors whose last outstanding read was ``request_number``."""
        ready = []
        for tensor_number in self._waiters[request_number]:
            self._remaining[tensor_number] -= 1
            if self._remaining[tensor_number] == 0:
                ready.append(tensor_number)
        return ready
