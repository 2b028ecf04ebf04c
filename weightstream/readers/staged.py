"""The staged reader: reads land in a ring of staging slots, and a copy engine moves each slot
to its place in the destination while the readers fill the next ones.

This is how bytes reach a GPU: pinned slots, ``cudaMemcpyAsync`` on a dedicated stream,
events to recycle slots (``weightstream.memory.cuda``). With the CPU engine the same code
runs in CI. Destination memory is allocated up front, one buffer per file; tensors are views
of it, yielded once every copy they need has completed. Cleanup follows the host reader:
the first failure stops the readers, in-flight copies finish, and nothing outlives the
generator.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from weightstream.memory.devices import check_fits
from weightstream.memory.ring import CopyEngine, CopyHandle, StagingRing
from weightstream.options import LoadOptions
from weightstream.planning.plan import PAGE, LoadPlan, ReadRequest, layout_file
from weightstream.readers.files import FileHandles
from weightstream.readers.tasks import buffer_tensor, read_request, start_readers, tensors_as_read
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


def read_staged(store: Store, plan: LoadPlan, opts: LoadOptions, staging: Staging) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan`` in ``staging``'s memory, in completion order.

    Example:
        >>> for name, tensor in read_staged(LocalStore(), plan, opts, CudaStaging("cuda:0")):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    check_fits(plan.total_bytes, opts.device, plan.uri)
    chunk_bytes = min(opts.request_bytes(plan.uri), opts.staging_slot_bytes)
    layouts = [layout_file(plan.tensors_of(spec.path), chunk_bytes) for spec in plan.files]
    layouts = [layout for layout in layouts if layout.tensor_offsets]
    specs = {spec.path: spec for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        files = cleanup.enter_context(FileHandles(store, opts))
        sources = [files.source(specs[layout.file]) for layout in layouts]
        destinations = [staging.allocate(layout.buffer_bytes, layout.file) for layout in layouts]
        cleanup.callback(destinations.clear)
        ring = staging_ring(staging, opts)
        cleanup.callback(ring.close)
        readers, stop, futures = start_readers(cleanup, opts)
        for file_number, (layout, source) in enumerate(zip(layouts, sources, strict=True)):
            for request_number, request in enumerate(layout.requests):
                task = readers.submit(stage_request, source, request, destinations[file_number], ring, stop, opts)
                futures[task] = (file_number, request_number)
        yield from tensors_as_read(
            layouts, futures, lambda file, tensor: buffer_tensor(layouts[file], destinations[file], tensor), on_result=ring.wait
        )


def staging_ring(staging: Staging, opts: LoadOptions) -> StagingRing:
    """The ring of one staged load: ``staging_slots`` slots of ``staging_slot_bytes``, each with a
    page to spare (a direct read widens a request by up to one page)."""
    return StagingRing(staging.engine(), opts.staging_slot_bytes + PAGE, opts.staging_slots, pinned=staging.pinned)


def stage_request(
    source: Source, request: ReadRequest, destination: torch.Tensor, ring: StagingRing, stop: threading.Event, opts: LoadOptions
) -> CopyHandle | None:
    """Read ``request`` into a free slot and launch its copy; the slot goes back to the ring either way."""
    if stop.is_set():
        return None
    slot = ring.acquire()
    launched = False
    try:
        if stop.is_set():
            return None
        at = request.offset % PAGE if source.direct else 0
        read_request(source, request, slot.view, at)
        if opts.progress is not None:
            opts.progress(request.nbytes)
        handle = ring.launch(slot, request.nbytes, destination[request.dest_offset : request.dest_offset + request.nbytes], start=at)
        launched = True
        return handle
    finally:
        if not launched:
            ring.release(slot)
