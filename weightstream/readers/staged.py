"""The staged reader: reads land in a ring of staging slots, and a copy engine moves each slot
to its place in the destination while the readers fill the next ones.

This is how bytes reach a GPU: pinned slots, ``cudaMemcpyAsync`` on a dedicated stream,
events to recycle slots (``weightstream.memory.cuda``). With the CPU engine the same code
runs in CI. Destination memory is the streaming reader's window (``readers.streaming``): a
batch of tensors gets its device buffer as it enters the window and leaves it with its last
tensor, so an engine that copies each tensor into its parameters and drops it holds its
parameters plus the window on the GPU, never the whole checkpoint beside them. Tensors are views
of their batch's buffer, yielded once every copy they need has completed. Cleanup follows the
host reader: the first failure stops the readers, in-flight copies finish, and nothing outlives
the generator.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from weightstream.errors import TruncatedFileError
from weightstream.memory.devices import check_fits
from weightstream.memory.host import view_as
from weightstream.memory.ring import CopyEngine, CopyHandle, StagingRing
from weightstream.options import LoadOptions
from weightstream.planning.plan import PAGE, FileLayout, LoadPlan, ReadRequest, TensorSpec
from weightstream.readers.streaming import read_windowed, window_bytes
from weightstream.readers.tasks import read_request
from weightstream.sources.base import Source, Store


class Staging(Protocol):
    """A destination reached through staging slots: where the bytes end and what copies them."""

    pinned: bool
    """Whether the staging slots must be page-locked (the CUDA engine's DMA needs it)."""
    device: torch.device
    """Where the destination memory is."""

    def engine(self) -> CopyEngine:
        """A fresh copy engine for one load."""

    def allocate(self, nbytes: int, file: str) -> torch.Tensor:
        """``nbytes`` of uint8 destination memory for ``file``'s tensors."""


def read_staged(
    store: Store, plan: LoadPlan, opts: LoadOptions, staging: Staging, max_inflight_bytes: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan`` in ``staging``'s memory, in completion order,
    holding at most the window (``max_inflight_bytes``, or the default for ``None``) of destination memory
    that the caller has not been given yet.

    Example:
        >>> for name, tensor in read_staged(LocalStore(), plan, opts, CudaStaging("cuda:0")):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    window = window_bytes(plan, opts, max_inflight_bytes)
    check_fits(window, str(staging.device), plan.uri)
    chunk_bytes = min(opts.request_bytes(plan.uri), opts.staging_slot_bytes)
    with contextlib.ExitStack() as cleanup:
        ring = staging_ring(staging, opts)
        cleanup.callback(ring.close)
        yield from read_windowed(cleanup, store, plan, opts, StagedLanding(staging, ring, opts), chunk_bytes, window)


class DeviceBatch:
    """One batch's destination memory (uint8), with its tensors as views."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def tensor(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        return view_as(self.buffer, offset, spec)


class StagedLanding:
    """Batches in ``staging``'s memory; each request read into a slot of ``ring``, then copied to its place."""

    def __init__(self, staging: Staging, ring: StagingRing, opts: LoadOptions) -> None:
        self._staging = staging
        self._ring = ring
        self._opts = opts

    def allocate(self, layout: FileLayout, source: Source) -> DeviceBatch:
        return DeviceBatch(self._staging.allocate(layout.buffer_bytes, layout.file))

    def read(
        self, source: Source, request: ReadRequest, memory: DeviceBatch, stop: threading.Event
    ) -> CopyHandle | None:
        return stage_request(source, request, memory.buffer, self._ring, stop, self._opts)

    def landed(self, handle: CopyHandle | None) -> None:
        if handle is not None:
            self._ring.wait(handle)


def staging_ring(staging: Staging, opts: LoadOptions) -> StagingRing:
    """The ring of one staged load: ``staging_slots`` slots of ``staging_slot_bytes``, each with a
    page to spare (a direct read widens a request by up to one page)."""
    return StagingRing(staging.engine(), opts.staging_slot_bytes + PAGE, opts.staging_slots, pinned=staging.pinned)


def stage_request(
    source: Source,
    request: ReadRequest,
    destination: torch.Tensor,
    ring: StagingRing,
    stop: threading.Event,
    opts: LoadOptions,
) -> CopyHandle | None:
    """Read ``request`` into a free slot and launch its copy; the slot goes back to the ring either way. A source
    with memory the copy engine reads directly (the node cache's, for a CUDA destination) is copied from, with no
    slot and no read."""
    if stop.is_set():
        return None
    target = destination[request.dest_offset : request.dest_offset + request.nbytes]
    copy_source = getattr(source, "copy_source", None)
    if copy_source is not None:
        if request.offset + request.nbytes > source.size:
            raise TruncatedFileError(
                f"{source.uri}: bytes {request.offset}..{request.offset + request.nbytes} asked of a "
                f"{source.size}-byte file"
            )
        handle = ring.launch_direct(copy_source[request.offset : request.offset + request.nbytes], target)
        if opts.progress is not None:
            opts.progress(request.nbytes)
        return handle
    slot = ring.acquire()
    launched = False
    try:
        if stop.is_set():
            return None
        at = request.offset % PAGE if source.direct else 0
        read_request(source, request, slot.view, at)
        if opts.progress is not None:
            opts.progress(request.nbytes)
        handle = ring.launch(slot, request.nbytes, target, start=at)
        launched = True
        return handle
    finally:
        if not launched:
            ring.release(slot)
