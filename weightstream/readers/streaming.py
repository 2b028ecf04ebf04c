"""The streaming reader: concurrent range reads in a bounded window of destination memory,
tensors yielded in completion order.

The checkpoint is cut into batches: runs of adjacent tensors of up to ``chunk_bytes`` (one
request), or one larger tensor (several requests into its own buffer). A batch gets its memory
when it enters the window and leaves the window when its last tensor has been yielded; from then
on its memory belongs to the caller's tensors alone, so a caller that drops each tensor holds the
process to ``max_inflight_bytes`` above its baseline. Batches enter in file order while they fit,
but for a lead batch of small tensors that enters first (its read completes first, so the first
tensor does not wait for a wave of full-size requests); their requests run on ``threads`` reader
threads, each landing straight in the batch's memory.

Cleanup follows the host reader: the first failure stops the readers, every source is closed,
the window's memory is released, and no thread outlives the generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from weightstream.errors import InvalidOptionError
from weightstream.memory.devices import check_fits
from weightstream.memory.host import HostArena
from weightstream.options import DEFAULT_INFLIGHT_BYTES, LoadOptions
from weightstream.planning.plan import (
    PAGE,
    FileLayout,
    LoadPlan,
    ReadRequest,
    TensorSpec,
    layout_file,
    round_up_to_page,
)
from weightstream.readers.files import FileHandles
from weightstream.readers.tasks import Completions, Waiting, read_into_arena, start_readers, wants_huge_pages
from weightstream.sources.base import Source, Store


@dataclasses.dataclass(frozen=True)
class Batch:
    """Tensors read together into one buffer: ``layout`` places them, ``file`` indexes the plan's open sources."""

    file: int
    layout: FileLayout


def plan_batches(plan: LoadPlan, chunk_bytes: int, lead_bytes: int | None = None) -> list[Batch]:
    """Cut each file's selected tensors into batches, in file order, then offset order.

    With ``lead_bytes``, the first run of tensors of at most that size each (and together; at most
    ``chunk_bytes``), in the first file, is a batch of its own and comes first: its one small read is
    the first to complete while the others share the bandwidth, so the first tensor lands after about
    ``lead_bytes`` times the readers' count, not after the first wave of full-size requests (a checkpoint often starts
    with its largest tensor, the embedding).

    Example:
        >>> specs = [TensorSpec(f"w{i}", torch.uint8, (3000,), "f", 8 + 3000 * i, 3000) for i in range(3)]
        >>> plan = LoadPlan("f", (), tuple(specs))
        >>> [[spec.name for spec, _ in batch.layout.tensor_offsets] for batch in plan_batches(plan, 8192)]
        [['w0', 'w1'], ['w2']]
        >>> [[spec.name for spec, _ in batch.layout.tensor_offsets] for batch in plan_batches(plan, 8192, 4096)]
        [['w0'], ['w1', 'w2']]
    """
    batches: list[Batch] = []
    lead: list[Batch] = []
    for file_number, path in enumerate(dict.fromkeys(spec.file for spec in plan.tensors)):
        specs = list(plan.tensors_of(path))
        if lead_bytes is not None and file_number == 0:
            first, end = _lead_run(specs, min(lead_bytes, chunk_bytes))
            lead = _cut(file_number, specs[first:end], chunk_bytes)
            batches += _cut(file_number, specs[:first], chunk_bytes)
            specs = specs[end:]
        batches += _cut(file_number, specs, chunk_bytes)
    return lead + batches


def _lead_run(specs: list[TensorSpec], lead_bytes: int) -> tuple[int, int]:
    """Where the first run of tensors of at most ``lead_bytes`` each and together starts and ends in ``specs``."""
    first = next((number for number, spec in enumerate(specs) if spec.nbytes <= lead_bytes), len(specs))
    end, total = first, 0
    while end < len(specs) and total + specs[end].nbytes <= lead_bytes:
        total += specs[end].nbytes
        end += 1
    return first, end


def _cut(file_number: int, specs: list[TensorSpec], chunk_bytes: int) -> list[Batch]:
    """``specs`` (of one file, in offset order) in batches of up to ``chunk_bytes``, or one larger tensor."""
    batches, group, grouped = [], [], 0
    for spec in specs:
        if group and grouped + spec.nbytes > chunk_bytes:
            batches.append(Batch(file_number, layout_file(group, chunk_bytes)))
            group, grouped = [], 0
        group.append(spec)
        grouped += spec.nbytes
    if group:
        batches.append(Batch(file_number, layout_file(group, chunk_bytes)))
    return batches


def window_bytes(plan: LoadPlan, opts: LoadOptions, max_inflight_bytes: int | None) -> int:
    """The window this load streams through: ``max_inflight_bytes``, or the default for ``None``.

    Raises:
        InvalidOptionError: ``max_inflight_bytes`` cannot hold one read request or the largest selected tensor.
    """
    largest = max(plan.tensors, key=lambda spec: spec.nbytes, default=None)
    needed = 0 if largest is None else round_up_to_page(largest.nbytes) + PAGE  # a run may start mid-page
    if max_inflight_bytes is None:
        return max(DEFAULT_INFLIGHT_BYTES, needed)
    if max_inflight_bytes < opts.request_bytes(plan.uri):
        raise InvalidOptionError(
            f"max_inflight_bytes={max_inflight_bytes} ({_mib(max_inflight_bytes)}) is less than one read request of "
            f"{plan.uri} ({opts.request_bytes(plan.uri)} bytes, {_mib(opts.request_bytes(plan.uri))}: chunk_bytes); "
            "lower chunk_bytes or raise the window"
        )
    if needed > max_inflight_bytes:
        assert largest is not None  # needed is 0 without a tensor
        raise InvalidOptionError(
            f"max_inflight_bytes={max_inflight_bytes} ({_mib(max_inflight_bytes)}) cannot hold tensor "
            f"{largest.name!r} of {largest.file} ({largest.nbytes} bytes, {needed} with page alignment): the window "
            f"holds at least the largest tensor, so at least {-(-needed // 2**20)} MiB here; or leave it unset (1 GiB, "
            "or the largest tensor where that is bigger)"
        )
    return max_inflight_bytes


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"


class BatchMemory(Protocol):
    """The memory of one batch in the window."""

    def tensor(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """The tensor ``spec`` whose bytes sit at ``offset``."""


class Landing(Protocol):
    """Where a windowed load's batches get their memory and how a request's bytes reach it: straight
    into host memory (:class:`HostLanding`), or through the staging ring to a device (``readers.staged``)."""

    def allocate(self, layout: FileLayout, source: Source) -> BatchMemory:
        """Memory for a batch of ``layout.buffer_bytes``, read from ``source``."""

    def read(self, source: Source, request: ReadRequest, memory: BatchMemory, stop: threading.Event) -> Any:
        """A reader thread's task: bring ``request``'s bytes to ``memory``, unless the load stopped."""

    def landed(self, result: Any) -> None:
        """Called with a read's result before the tensors it completes are yielded (waits for a staged copy)."""


class HostLanding:
    """Batches in host memory (pinned if asked), each request read straight into it."""

    def __init__(self, opts: LoadOptions, *, pinned: bool) -> None:
        self._opts = opts
        self._pinned = pinned

    def allocate(self, layout: FileLayout, source: Source) -> HostArena:
        return HostArena(layout.buffer_bytes, huge_pages=wants_huge_pages(source, self._opts), pinned=self._pinned)

    def read(self, source: Source, request: ReadRequest, memory: BatchMemory, stop: threading.Event) -> None:
        read_into_arena(source, request, memory, stop, self._opts)

    def landed(self, result: None) -> None:
        """Host reads land in place: nothing to wait for."""


def read_streaming(
    store: Store, plan: LoadPlan, opts: LoadOptions, *, pinned: bool, max_inflight_bytes: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan`` in completion order, within a window of
    ``max_inflight_bytes`` (``None``: the default window).

    Example:
        >>> for name, tensor in read_streaming(store, plan, LoadOptions(), pinned=False):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    window = window_bytes(plan, opts, max_inflight_bytes)
    check_fits(window, opts.device, plan.uri)
    with contextlib.ExitStack() as cleanup:
        yield from read_windowed(
            cleanup, store, plan, opts, HostLanding(opts, pinned=pinned), opts.request_bytes(plan.uri), window
        )


def read_windowed(
    cleanup: contextlib.ExitStack,
    store: Store,
    plan: LoadPlan,
    opts: LoadOptions,
    landing: Landing,
    chunk_bytes: int,
    window: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The window's read loop: batches of ``chunk_bytes`` requests get memory from ``landing`` as they
    enter a window of ``window`` bytes, and leave it with their last yielded tensor. Every resource is
    registered with ``cleanup``, which the caller closes (after its own, registered earlier)."""
    batches = plan_batches(plan, chunk_bytes, lead_bytes=max(PAGE, chunk_bytes // opts.reader_threads))
    paths = list(dict.fromkeys(spec.file for spec in plan.tensors))
    specs = {spec.path: spec for spec in plan.files}
    files = cleanup.enter_context(FileHandles(store, opts))
    sources = [files.source(specs[path]) for path in paths]
    # Batch number -> its memory, while the batch is in the window. Registered before the readers, so
    # that it is emptied after the readers writing into it have stopped.
    memories: dict[int, BatchMemory] = {}
    cleanup.callback(memories.clear)
    readers, stop, futures = start_readers(cleanup, opts)
    window_state = _Window(batches, memories, window)
    completions = Completions()
    while window_state.admitted < len(batches) or futures:
        while window_state.fits_next():
            number = window_state.admitted
            batch = batches[number]
            source = sources[batch.file]
            window_state.admit(landing.allocate(batch.layout, source))
            for request_number, request in enumerate(batch.layout.requests):
                future = readers.submit(landing.read, source, request, memories[number], stop)
                futures[future] = (number, request_number)
                completions.add(future)
            for tensor_number in window_state.ready_without_reads(number):
                named = window_state.take(number, tensor_number)
                yield named
                del named  # once yielded, the caller's tensor alone keeps the memory
        if not futures:
            continue
        future = completions.next()
        landing.landed(future.result())
        number, request_number = futures.pop(future)
        for tensor_number in window_state.request_done(number, request_number):
            named = window_state.take(number, tensor_number)
            yield named
            del named


class _Window:
    """Which batches hold memory, how much, and which of their tensors are still to be yielded."""

    def __init__(self, batches: list[Batch], memories: dict[int, BatchMemory], limit: int) -> None:
        self.batches = batches
        self.memories = memories
        self.limit = limit
        self.held = 0
        self.admitted = 0
        self._waiting: dict[int, Waiting] = {}
        self._unyielded: dict[int, int] = {}

    def fits_next(self) -> bool:
        """Whether the next batch may enter: it fits beside the others, or the window is empty."""
        if self.admitted == len(self.batches):
            return False
        return self.held == 0 or self.held + self.batches[self.admitted].layout.buffer_bytes <= self.limit

    def admit(self, memory: BatchMemory) -> None:
        layout = self.batches[self.admitted].layout
        self.memories[self.admitted] = memory
        self.held += layout.buffer_bytes
        self._waiting[self.admitted] = Waiting(layout)
        self._unyielded[self.admitted] = len(layout.tensor_offsets)
        self.admitted += 1

    def ready_without_reads(self, number: int) -> list[int]:
        return self._waiting[number].ready_without_reads()

    def request_done(self, number: int, request_number: int) -> list[int]:
        return self._waiting[number].request_done(request_number)

    def take(self, number: int, tensor_number: int) -> tuple[str, torch.Tensor]:
        """The tensor, to be yielded; the batch leaves the window with its last tensor."""
        spec, offset = self.batches[number].layout.tensor_offsets[tensor_number]
        named = spec.name, self.memories[number].tensor(offset, spec)
        self._unyielded[number] -= 1
        if not self._unyielded[number]:
            del self._unyielded[number], self._waiting[number], self.memories[number]
            self.held -= self.batches[number].layout.buffer_bytes
        return named
