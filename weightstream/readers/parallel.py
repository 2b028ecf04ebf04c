"""The parallel reader: a plan's coalesced requests, executed by a thread pool straight
into caller-owned memory, with each tensor yielded as soon as its last byte lands.

All or nothing: the first failing read stops the others (queued reads are cancelled,
running ones finish, since their memory must not vanish under them), every file is
closed and no thread outlives the generator, whether it ends normally, by an error,
or because the consumer stopped iterating.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from weightstream.errors import DeviceUnavailableError, logger
from weightstream.memory.devices import check_destination, check_fits
from weightstream.memory.host import HostArena, view_as
from weightstream.nodecache.client import SegmentSource
from weightstream.options import LoadOptions
from weightstream.planning.plan import FileLayout, LoadPlan, layout_file
from weightstream.readers.files import FileHandles
from weightstream.readers.tasks import (
    read_into_arena,
    start_readers,
    tensors_as_read,
    wants_huge_pages,
)
from weightstream.sources.base import Store
from weightstream.sources.local.file import LocalStore
from weightstream.sources.local.mapped import MappedFile

log = logger(__name__)


def read_tensors(store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan``, in completion order.

    Example:
        >>> for name, tensor in read_tensors(LocalStore(), plan, LoadOptions()):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    if wants_views(store, opts):
        yield from _mapped_tensors(store, plan, opts)
        return
    if torch.device(opts.device).type == "cuda":
        yield from _cuda_tensors(store, plan, opts)
        return
    pinned = check_destination(opts.device, opts.pin_memory)
    check_fits(plan.total_bytes, opts.device, plan.uri)
    layouts = [layout_file(plan.tensors_of(spec.path), opts.request_bytes(plan.uri)) for spec in plan.files]
    layouts = [layout for layout in layouts if layout.tensor_offsets]
    specs = {spec.path: spec for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        files = cleanup.enter_context(FileHandles(store, opts))
        sources = [files.source(specs[layout.file]) for layout in layouts]
        arenas = [
            HostArena(layout.buffer_bytes, huge_pages=wants_huge_pages(source, opts), pinned=pinned)
            for layout, source in zip(layouts, sources, strict=True)
        ]
        # Registered before the executors' shutdown, so it runs after the readers stopped writing.
        # Dropping the arenas here (not when a traceback lets go of this frame) frees the memory at once.
        cleanup.callback(arenas.clear)
        readers, stop, futures = start_readers(cleanup, opts)
        for file_number, (layout, source, arena) in enumerate(zip(layouts, sources, arenas, strict=True)):
            for request_number, request in enumerate(layout.requests):
                read = readers.submit(read_into_arena, source, request, arena, stop, opts)
                futures[read] = (file_number, request_number)
        # No variable of this frame may hold an arena itself (only the list the cleanup empties):
        # a traceback through it would keep the memory.
        yield from tensors_as_read(layouts, futures, lambda file, tensor: _tensor(layouts[file], arenas[file], tensor))


def _cuda_tensors(store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """GPUDirect Storage when asked for (and, on "auto", real), else the staging ring."""
    from weightstream.memory import gds
    from weightstream.memory.cuda import CudaStaging

    device = CudaStaging(opts.device)
    if opts.gds is not False:
        reason = gds.unavailable_reason(need_nvidia_fs=opts.gds == "auto")
        if reason is None and not isinstance(store, LocalStore):
            reason = f"{plan.uri} is not a local file"
        if reason is None:
            from weightstream.readers.gds import read_gds

            yield from read_gds(plan, opts, device)
            return
        if opts.gds is True:
            raise DeviceUnavailableError(f"gds=True: GPUDirect Storage is not available: {reason}")
        log.info("gds='auto': reading through the staging ring: %s", reason)
    from weightstream.readers.staged import read_staged

    yield from read_staged(store, plan, opts, device)


def wants_views(store: Store, opts: LoadOptions) -> bool:
    """Whether tensors are views of file mappings (or of the node cache's device copies, on a GPU):
    ``zero_copy=True``, or ``"auto"`` over the node cache's shared memory (to the pageable CPU)."""
    if opts.zero_copy is True:
        return True
    shared = getattr(store, "shares_memory", False)
    return opts.zero_copy == "auto" and shared and torch.device(opts.device).type == "cpu" and opts.pin_memory is False


def _mapped_tensors(store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """``zero_copy``: views of each file's private mapping, after checking the file is unchanged; on a GPU, views
    of the node cache daemon's read-only copies there."""
    device = torch.device(opts.device)
    if device.type == "cuda":
        check_destination(opts.device, opts.pin_memory)
        if not getattr(store, "shares_memory", False):
            raise DeviceUnavailableError(
                f"zero_copy=True on {opts.device}: {plan.uri} is not read through a node cache daemon (cache= found "
                "none), whose device copies it would view"
            )
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    for spec in plan.files:
        tensors = plan.tensors_of(spec.path)
        if not tensors:
            continue
        mapped = store.mapped(spec.path, spec.size, spec.version)  # type: ignore[attr-defined]
        try:
            for tensor in tensors:  # no local may hold the mapping (see below)
                yield tensor.name, view_as(_file_bytes(mapped, device), tensor.offset, tensor)
            mapped.verify_unchanged()
        finally:
            mapped.close()  # a failed load's traceback holds this frame: it must not hold the mapping too
        if opts.progress is not None:
            opts.progress(sum(tensor.nbytes for tensor in tensors))


def _file_bytes(mapped: MappedFile | SegmentSource, device: torch.device) -> torch.Tensor:
    """A mapped file's bytes: its mapping on the CPU, the node cache daemon's copy of it on a GPU."""
    return mapped.bytes if device.type == "cpu" else mapped.device_bytes(device)  # type: ignore[union-attr]


def _tensor(layout: FileLayout, arena: HostArena, tensor_number: int) -> tuple[str, torch.Tensor]:
    spec, offset = layout.tensor_offsets[tensor_number]
    return spec.name, arena.tensor(offset, spec)
