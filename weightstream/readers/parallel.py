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
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from weightstream.errors import DeviceUnavailableError, logger
from weightstream.memory.devices import check_fits
from weightstream.memory.host import HostArena, view_as
from weightstream.options import LoadOptions
from weightstream.planning.plan import FileLayout, LoadPlan, layout_file
from weightstream.readers.destination import Destination, Route
from weightstream.readers.files import FileHandles
from weightstream.readers.tasks import (
    buffer_tensor,
    read_into_arena,
    start_readers,
    tensors_as_read,
    wants_huge_pages,
)
from weightstream.sources.base import Mapped, MappedBytes, SharedMemory, Source, Store
from weightstream.workers import WorkerPool

log = logger(__name__)


def read_tensors(
    store: Store, plan: LoadPlan, opts: LoadOptions, destination: Destination
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan``, in completion order, by ``destination``'s route.

    Example:
        >>> destination = choose_destination(LocalStore(), plan.uri, LoadOptions(), "safetensors")  # doctest: +SKIP
        >>> for name, tensor in read_tensors(LocalStore(), plan, LoadOptions(), destination):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    if destination.route is Route.VIEWS:
        yield from _mapped_tensors(store, plan, opts, destination.device)
        return
    if destination.route is Route.GDS:
        from weightstream.memory.cuda import CudaStaging
        from weightstream.readers.gds import read_gds

        yield from read_gds(store, plan, opts, CudaStaging(destination.device))  # type: ignore[arg-type]  # DirectIO: checked
        return
    if destination.route is Route.STAGED:
        from weightstream.memory.cuda import CudaStaging
        from weightstream.readers.staged import read_staged

        yield from read_staged(store, plan, opts, CudaStaging(destination.device))
        return
    check_fits(plan.total_bytes, opts.device, plan.uri)
    layouts = [layout_file(plan.tensors_of(spec.path), opts.request_bytes(plan.uri)) for spec in plan.files]
    layouts = [layout for layout in layouts if layout.tensor_offsets]
    specs = {spec.path: spec for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        files = cleanup.enter_context(FileHandles(store, opts))
        sources = [files.source(specs[layout.file]) for layout in layouts]
        arenas = [
            HostArena(layout.buffer_bytes, huge_pages=wants_huge_pages(source, opts), pinned=destination.pinned)
            for layout, source in zip(layouts, sources, strict=True)
        ]
        # Registered before the readers' shutdown, so it runs after the readers stopped writing.
        # Dropping the arenas here (not when a traceback lets go of this frame) frees the memory at once.
        cleanup.callback(arenas.clear)
        readers, stop, futures = start_readers(cleanup, opts)
        _submit_reads(readers, layouts, sources, arenas, stop, opts, futures)
        # No variable of this frame may hold an arena itself (only the list the cleanup empties):
        # a traceback through it would keep the memory.
        yield from tensors_as_read(
            layouts, futures, lambda file, tensor: buffer_tensor(layouts[file], arenas[file].bytes, tensor)
        )


def _mapped_tensors(
    store: Store, plan: LoadPlan, opts: LoadOptions, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each file's private mapping (checked unchanged after), or on a GPU of the node cache daemon's
    read-only copies there."""
    for spec in plan.files:
        tensors = plan.tensors_of(spec.path)
        if not tensors:
            continue
        mapped = _mapped(store, spec.path, spec.size, spec.version, device)
        try:
            for tensor in tensors:  # no local may hold the mapping (see below)
                yield tensor.name, view_as(_file_bytes(mapped, device), tensor.offset, tensor)
            mapped.verify_unchanged()
        finally:
            mapped.close()  # a failed load's traceback holds this frame: it must not hold the mapping too
        if opts.progress is not None:
            opts.progress(sum(tensor.nbytes for tensor in tensors))


def _mapped(store: Store, path: str, size: int, version: str | None, device: torch.device) -> MappedBytes:
    """The node cache's shared bytes where the store is one (on a GPU it must be), else the file's mapping."""
    if isinstance(store, SharedMemory):
        return store.shared(path, size, version)
    if isinstance(store, Mapped) and device.type == "cpu":
        return store.mapped(path, size, version)
    raise DeviceUnavailableError(f"{path}: no mapping of it to view on {device}")  # choose_destination refused it


def _file_bytes(mapped: MappedBytes, device: torch.device) -> torch.Tensor:
    """A mapped file's bytes: its mapping on the CPU, the node cache daemon's copy of it on a GPU."""
    return mapped.bytes if device.type == "cpu" else mapped.device_bytes(device)  # type: ignore[attr-defined]


def _submit_reads(
    readers: WorkerPool,
    layouts: list[FileLayout],
    sources: list[Source],
    arenas: list[HostArena],
    stop: threading.Event,
    opts: LoadOptions,
    futures: dict[Future, tuple[int, int]],
) -> None:
    """Queue every request of every file; a function of its own so that no local of the reading generator's frame
    holds an arena (a traceback through that frame would keep its memory)."""
    for file_number, (layout, source, arena) in enumerate(zip(layouts, sources, arenas, strict=True)):
        for request_number, request in enumerate(layout.requests):
            futures[readers.submit(read_into_arena, source, request, arena, stop, opts)] = (file_number, request_number)
