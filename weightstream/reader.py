"""The parallel reader: a plan's coalesced requests, executed by a thread pool straight
into caller-owned memory, with each tensor yielded as soon as its last byte lands.

All or nothing: the first failing read stops the others (queued reads are cancelled,
running ones finish, since their memory must not vanish under them), every file is
closed and no thread outlives the generator, whether it ends normally, by an error,
or because the consumer stopped iterating.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from weightstream.memory.host import HostArena, MappedFile
from weightstream.options import LoadOptions
from weightstream.plan import PAGE, FileLayout, LoadPlan, ReadRequest, layout_file, round_up_to_page
from weightstream.sources.base import Source, Store, check_unchanged

THREAD_NAME_PREFIX = "weightstream-read"


def read_tensors(store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan``, in completion order.

    Example:
        >>> for name, tensor in read_tensors(LocalStore(), plan, LoadOptions()):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    if opts.zero_copy:
        yield from _mapped_tensors(plan, opts)
        return
    layouts = [layout_file(plan.tensors_of(spec.path), opts.chunk_bytes) for spec in plan.files]
    layouts = [layout for layout in layouts if layout.tensor_offsets]
    sizes = {spec.path: spec.size for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        sources = [cleanup.enter_context(_open(store, layout.file, sizes[layout.file], opts)) for layout in layouts]
        arenas = [HostArena(layout.buffer_bytes, huge_pages=_huge_pages(source, opts)) for layout, source in zip(layouts, sources, strict=True)]
        # Registered before the executors' shutdown, so it runs after the readers stopped writing.
        # Dropping the arenas here (not when a traceback lets go of this frame) frees the memory at once.
        cleanup.callback(arenas.clear)
        futures: dict[Future, tuple[int, int]] = {}
        cleanup.callback(_forget_failures, futures)
        stop = threading.Event()
        readers = ThreadPoolExecutor(max_workers=opts.reader_threads, thread_name_prefix=THREAD_NAME_PREFIX)
        cleanup.callback(readers.shutdown, wait=True, cancel_futures=True)
        cleanup.callback(stop.set)
        if opts.prefault:
            prefaulter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX + "-prefault")
            cleanup.callback(prefaulter.shutdown, wait=True, cancel_futures=True)
            _submit_prefaults(prefaulter, layouts, arenas)
        _submit_reads(readers, layouts, sources, arenas, stop, opts, futures)
        # No loop variable of this frame may hold an arena: a traceback through it would keep the memory.
        waiting = [_Waiting(layout) for layout in layouts]
        for file_number, tensors in enumerate(waiting):
            for tensor_number in tensors.ready_without_reads():
                yield _tensor(layouts[file_number], arenas[file_number], tensor_number)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()
                file_number, request_number = futures.pop(future)
                for tensor_number in waiting[file_number].request_done(request_number):
                    yield _tensor(layouts[file_number], arenas[file_number], tensor_number)


def _mapped_tensors(plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """``zero_copy``: views of each file's private mapping, after checking the file is unchanged."""
    for spec in plan.files:
        tensors = plan.tensors_of(spec.path)
        if not tensors:
            continue
        mapped = MappedFile(spec.path, spec.size)
        for tensor in tensors:
            yield tensor.name, mapped.tensor(tensor)
        if opts.progress is not None:
            opts.progress(sum(tensor.nbytes for tensor in tensors))


def _submit_prefaults(prefaulter: ThreadPoolExecutor, layouts: list[FileLayout], arenas: list[HostArena]) -> None:
    """Page faults of fresh memory cost more than the copy on these VMs: one thread takes them ahead
    of the readers, which then copy (or DMA) into memory that is already there."""
    for layout, arena in zip(layouts, arenas, strict=True):
        for request in layout.requests:
            prefaulter.submit(arena.populate, request.dest_offset, request.nbytes)


def _submit_reads(
    readers: ThreadPoolExecutor,
    layouts: list[FileLayout],
    sources: list[Source],
    arenas: list[HostArena],
    stop: threading.Event,
    opts: LoadOptions,
    futures: dict[Future, tuple[int, int]],
) -> None:
    for file_number, (layout, source, arena) in enumerate(zip(layouts, sources, arenas, strict=True)):
        for request_number, request in enumerate(layout.requests):
            futures[readers.submit(_read, source, request, arena.view, stop, opts)] = (file_number, request_number)


@contextlib.contextmanager
def _open(store: Store, path: str, planned_size: int, opts: LoadOptions) -> Iterator[Source]:
    source = store.open(path, direct=opts.direct_io)
    try:
        check_unchanged(path, planned_size, source.size)
        yield source
    finally:
        source.close()


def _huge_pages(source: Source, opts: LoadOptions) -> bool:
    """Huge pages pay off for direct reads; recycled 4 KiB pages fault in faster for buffered ones."""
    return source.direct if opts.huge_pages == "auto" else opts.huge_pages


def _forget_failures(futures: Iterable[Future]) -> None:
    """Drop the locals of failed readers' frames: they hold views of the arenas, and the
    memory of a failed load must not live as long as the caller keeps the exception."""
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is not None:
            traceback.clear_frames(future.exception().__traceback__)


def _read(source: Source, request: ReadRequest, view: memoryview, stop: threading.Event, opts: LoadOptions) -> None:
    if stop.is_set():
        return
    if source.direct:
        # Widen to whole pages: the layout keeps the extra bytes on pages no other run uses.
        head = request.offset % PAGE
        length = round_up_to_page(head + request.nbytes)
        start = request.dest_offset - head
        source.read_into(request.offset - head, view[start : start + length])
    else:
        source.read_into(request.offset, view[request.dest_offset : request.dest_offset + request.nbytes])
    if opts.progress is not None:
        opts.progress(request.nbytes)


def _tensor(layout: FileLayout, arena: HostArena, tensor_number: int) -> tuple[str, torch.Tensor]:
    spec, offset = layout.tensor_offsets[tensor_number]
    return spec.name, arena.tensor(offset, spec)


class _Waiting:
    """Which tensors of one file still wait for which reads."""

    def __init__(self, layout: FileLayout) -> None:
        self._remaining = [len(needed) for needed in layout.tensor_requests]
        self._waiters: list[list[int]] = [[] for _ in layout.requests]
        for tensor_number, needed in enumerate(layout.tensor_requests):
            for request_number in needed:
                self._waiters[request_number].append(tensor_number)

    def ready_without_reads(self) -> list[int]:
        return [number for number, count in enumerate(self._remaining) if count == 0]

    def request_done(self, request_number: int) -> list[int]:
        ready = []
        for tensor_number in self._waiters[request_number]:
            self._remaining[tensor_number] -= 1
            if self._remaining[tensor_number] == 0:
                ready.append(tensor_number)
        return ready
