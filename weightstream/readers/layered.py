"""The layered reader: a checkpoint layer by layer, through a few buffers it reuses.

``prefetch_layers + 1`` buffers of the largest layer's size are allocated once. Each layer's
tensors are read into one buffer (file by file, laid out as the host reader lays out a file) by
the reader threads, straight from the source or, for a GPU, through the pinned staging ring.

The caller receives views of a fresh alias of the buffer: its own storage over the same memory.
When the last tensor over the alias dies (the caller dropped the layer, however many views it
made of it), a finaliser hands the buffer to the keeper, a thread that gives it to the next layer
to read and starts that layer's reads at once, so the reads go on while the caller works.

The contract: when the caller asks for a layer, it may still hold at most ``prefetch_layers``
earlier layers. Asking while holding more would wait for ever; it raises ``LayerInUseError``
naming the layers still held instead. ``copy_layers`` yields copies the caller may keep.

Cleanup follows the host reader: the first failure stops the readers and the keeper, every source
is closed, the buffers are released (those of layers the caller holds live on with its tensors),
and no thread outlives the generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait

import torch
import torch.utils.dlpack

from weightstream.errors import LayerInUseError, OptionError, logger
from weightstream.memory.devices import check_fits
from weightstream.memory.host import HostArena, view_as
from weightstream.memory.ring import StagingRing
from weightstream.options import LoadOptions
from weightstream.planning.layers import Layer
from weightstream.planning.plan import FileLayout, LoadPlan, TensorSpec, layout_file
from weightstream.readers.files import FileHandles
from weightstream.readers.staged import Staging, stage_request, staging_ring
from weightstream.readers.tasks import (
    THREAD_NAME_PREFIX,
    read_into_arena,
    start_readers,
    wants_huge_pages,
)
from weightstream.sources.base import Source, Store

log = logger(__name__)

Tensors = dict[str, torch.Tensor]

LayerHook = Callable[[str, Tensors], "Mapping[str, torch.Tensor] | None"]
"""Called with each complete layer (key, tensors) before it is yielded; returns the tensors to yield
instead (e.g. quantized ones), or None to yield the layer as read."""


@dataclasses.dataclass(frozen=True)
class LayerReading:
    """How layers are handed over: how many are read ahead, copied or not, and the hook they pass."""

    prefetch_layers: int = 1
    """Layers read ahead of the one the caller holds (``prefetch_layers + 1`` buffers)."""
    copy_layers: bool = False
    """Yield copies instead of views of the reused buffers."""
    layer_hook: LayerHook | None = None
    """Called on each complete layer; what it returns is yielded."""


@dataclasses.dataclass(frozen=True)
class LayerPart:
    """The tensors of one layer stored in one file: ``layout`` places them from ``base`` in the layer's buffer."""

    file: int
    """Index of the file among the load's open sources."""
    base: int
    layout: FileLayout


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """Where one layer's tensors land in its buffer, and the reads that fetch them."""

    key: str
    tensors: tuple[TensorSpec, ...]
    parts: tuple[LayerPart, ...]
    buffer_bytes: int


def layout_layers(layers: Sequence[Layer], paths: Sequence[str], chunk_bytes: int) -> list[LayerLayout]:
    """Lay out each layer's tensors in a buffer of its own: one page-aligned part per file it spans.

    Example:
        >>> specs = [TensorSpec(f"layers.{i}.w", torch.uint8, (5000,), "f", 8 + 5000 * i, 5000) for i in range(2)]
        >>> layers = [Layer("a", (specs[0],)), Layer("b", (specs[1],))]
        >>> [(layout.key, layout.buffer_bytes) for layout in layout_layers(layers, ["f"], 8192)]
        [('a', 8192), ('b', 8192)]
    """
    numbers = {path: number for number, path in enumerate(paths)}
    layouts = []
    for layer in layers:
        parts, base = [], 0
        for path in dict.fromkeys(spec.file for spec in layer.tensors):
            layout = layout_file([spec for spec in layer.tensors if spec.file == path], chunk_bytes)
            parts.append(LayerPart(numbers[path], base, layout))
            base += layout.buffer_bytes
        layouts.append(LayerLayout(layer.key, layer.tensors, tuple(parts), base))
    return layouts


def read_layers(
    store: Store,
    plan: LoadPlan,
    layers: Sequence[Layer],
    opts: LoadOptions,
    reading: LayerReading,
    *,
    pinned: bool,
    staging: Staging | None = None,
) -> Iterator[tuple[str, Tensors]]:
    """Yield ``(layer key, {name: tensor})`` for each of ``layers`` in order, through reused buffers.

    Host memory (pinned if ``pinned``) receives the reads directly; with ``staging`` (a GPU) the
    buffers are the staging's memory, reached through the staging ring.

    Example:
        >>> layers, reading, opts = group_layers(plan.tensors), LayerReading(), LoadOptions()  # doctest: +SKIP
        >>> for key, tensors in read_layers(store, plan, layers, opts, reading, pinned=False):  # doctest: +SKIP
        ...     model.get_submodule(key).load_state_dict(tensors, strict=False)
    """
    request_bytes = opts.request_bytes(plan.uri)
    chunk_bytes = request_bytes if staging is None else min(request_bytes, opts.staging_slot_bytes)
    largest, count = max((layer.nbytes for layer in layers), default=0), min(reading.prefetch_layers + 1, len(layers))
    check_fits(largest * count, opts.device, f"{plan.uri} ({count} buffer(s) of its largest layer)")
    paths = list(dict.fromkeys(spec.file for spec in plan.tensors))
    layouts = layout_layers(layers, paths, chunk_bytes)
    files = {spec.path: spec for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        handles = cleanup.enter_context(FileHandles(store, opts))
        sources = [handles.source(files[path]) for path in paths]
        buffers = _Buffers(layouts, opts, count, sources, pinned, staging)
        cleanup.callback(buffers.clear)  # registered first: emptied after the readers stopped writing
        ring = None
        if staging is not None:
            ring = staging_ring(staging, opts)
            cleanup.callback(ring.close)
        readers, stop, futures = start_readers(cleanup, opts)

        def start(number: int, buffer: int) -> list[Future]:
            """Submit the reads of layer ``number`` into buffer ``buffer`` (called by the keeper)."""
            buffers.prepare_reuse(buffer)
            reads = []
            for part in layouts[number].parts:
                for request in part.layout.requests:
                    if ring is None:
                        read = readers.submit(
                            read_into_arena, sources[part.file], request, buffers.arena(buffer), stop, opts, part.base
                        )
                    else:
                        target = buffers.bytes(buffer)[part.base : part.base + part.layout.buffer_bytes]
                        read = readers.submit(stage_request, sources[part.file], request, target, ring, stop, opts)
                    futures[read] = (number, request)
                    reads.append(read)
            return reads

        keeper = _Keeper(len(layouts), len(buffers), start)
        cleanup.callback(keeper.stop)  # runs before the readers shut down: nothing submits after
        held = _HeldLayers(len(buffers), reading.prefetch_layers)
        for number, layout in enumerate(layouts):
            buffer, reads = keeper.wait_for(number, functools.partial(held.check, number, layout.key))
            _finish(reads, ring)
            if reading.copy_layers:
                tensors = _tensors_over(layout, buffers.copy_out(layout, buffer))
                keeper.released.put(buffer)
                held.add(layout.key, None)
            else:
                alias = torch.from_dlpack(
                    torch.utils.dlpack.to_dlpack(buffers.bytes(buffer))
                )  # own storage, same memory
                release = weakref.finalize(alias.untyped_storage(), keeper.released.put, buffer)
                release.atexit = False
                tensors = _tensors_over(layout, alias)
                del alias  # from here on, the tensors alone keep it alive
                held.add(layout.key, release)
            if reading.layer_hook is not None:
                tensors = _hooked(layout.key, tensors, reading.layer_hook)
            yield layout.key, tensors
            del tensors


class _Buffers:
    """The reused buffers of one load: host arenas, or memory of the staging's device."""

    def __init__(
        self,
        layouts: list[LayerLayout],
        opts: LoadOptions,
        count: int,
        sources: list[Source],
        pinned: bool,
        staging: Staging | None,
    ) -> None:
        capacity = max((layout.buffer_bytes for layout in layouts), default=0)
        self._pinned = pinned
        self._staging = staging
        self._huge_pages = any(wants_huge_pages(source, opts) for source in sources)
        self._filled: set[int] = set()
        self._arenas: list[HostArena] = []
        self._bytes: list[torch.Tensor] = []
        if staging is None:
            self._arenas = [HostArena(capacity, huge_pages=self._huge_pages, pinned=pinned) for _ in range(count)]
            self._bytes = [arena.bytes for arena in self._arenas]
        else:
            self._bytes = [staging.allocate(capacity, f"{capacity}-byte layer buffer") for _ in range(count)]

    def __len__(self) -> int:
        return len(self._bytes)

    def arena(self, number: int) -> HostArena:
        return self._arenas[number]

    def bytes(self, number: int) -> torch.Tensor:
        return self._bytes[number]

    def copy_out(self, layout: LayerLayout, number: int) -> torch.Tensor:
        """The layer in buffer ``number``, copied into fresh memory of the same kind (one copy for the whole layer)."""
        filled = self._bytes[number][: layout.buffer_bytes]
        if self._staging is None:
            copy = HostArena(layout.buffer_bytes, huge_pages=self._huge_pages, pinned=self._pinned).bytes
        else:
            copy = self._staging.allocate(layout.buffer_bytes, f"layer {layout.key!r}")
        return copy.copy_(filled)

    def prepare_reuse(self, number: int) -> None:
        """Before a buffer is filled again: the caller may have queued GPU work (a copy from its
        pinned tensors, a kernel on its device tensors) that is still reading the old layer."""
        if number in self._filled and (self._pinned or self._bytes[number].device.type == "cuda"):
            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
        self._filled.add(number)

    def clear(self) -> None:
        self._arenas.clear()
        self._bytes.clear()


class _Keeper:
    """Hands buffers to layers, in layer order, as they come back; a thread woken by each release.

    ``released`` receives buffer numbers: from the finalisers of the layers' aliases (in whatever
    thread drops the last tensor; ``SimpleQueue.put`` may be called from a finaliser), and at the
    start, every buffer once.
    """

    def __init__(self, layers: int, buffers: int, start: Callable[[int, int], list[Future]]) -> None:
        self.released: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._layers = layers
        self._start: Callable[[int, int], list[Future]] | None = start
        self._assigned: dict[int, tuple[int, list[Future]]] = {}
        self._condition = threading.Condition()
        self._error: BaseException | None = None
        for buffer in range(buffers):
            self.released.put(buffer)
        # A daemon: an abandoned iterator's keeper waits for buffers its caller never gives back, and
        # must not keep the interpreter from exiting (the load's stop flag ends its reads then).
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME_PREFIX + "-layers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for number in range(self._layers):
                buffer = self.released.get()
                if buffer is None:
                    return
                reads = self._start(number, buffer)
                with self._condition:
                    self._assigned[number] = (buffer, reads)
                    self._condition.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the generator, which raises it
            with self._condition:
                self._error = error
                self._condition.notify_all()

    def wait_for(self, number: int, check: Callable[[], None]) -> tuple[int, list[Future]]:
        """Layer ``number``'s buffer and reads, once assigned; ``check`` raises if it never will be."""
        with self._condition:
            while number not in self._assigned:
                if self._error is not None:
                    raise self._error
                check()
                self._condition.wait()
            return self._assigned.pop(number)

    def stop(self) -> None:
        self.released.put(None)
        self._thread.join()
        self._start = None  # the readers, sources and buffers it reaches are the load's to free


class _HeldLayers:
    """The layers yielded so far, and whether the caller still references each."""

    def __init__(self, buffers: int, prefetch: int) -> None:
        self._buffers = buffers
        self._prefetch = prefetch
        self._layers: list[tuple[str, weakref.finalize | None]] = []

    def add(self, key: str, release: weakref.finalize | None) -> None:
        """Layer ``key`` was yielded; ``release`` fires when the caller lets go of it (None: copies, released
        already)."""
        self._layers.append((key, release))

    def check(self, number: int, key: str) -> None:
        """Raise ``LayerInUseError`` if layer ``number`` can get no buffer: the buffers all hold
        yielded layers that the caller still references (after a garbage collection, for cycles)."""
        needed = number - self._buffers + 1  # releases before layer ``number`` has a buffer
        if needed <= self._released():
            return
        gc.collect()
        if needed <= self._released():
            return
        held = [layer for layer, release in self._layers if release is not None and release.alive]
        raise LayerInUseError(
            f"layer {key!r} needs one of the {self._buffers} buffers of prefetch_layers={self._prefetch}, but tensors "
            "of "
            f"{', '.join(map(repr, held))} are still referenced: when you ask for a layer you may hold at most "
            f"{self._prefetch} earlier one(s); copy what you keep (tensor.clone()) or pass copy_layers=True"
        )

    def _released(self) -> int:
        return sum(release is None or not release.alive for _, release in self._layers)


def _finish(reads: list[Future], ring: StagingRing | None) -> None:
    """Wait for a layer's reads (raising the first failure) and, through the ring, for their copies."""
    done, _ = wait(reads, return_when=FIRST_EXCEPTION)
    for read in done:
        read.result()
    if ring is not None:
        for read in reads:
            if read.result() is not None:
                ring.wait(read.result())


def _tensors_over(layout: LayerLayout, raw: torch.Tensor) -> Tensors:
    """The layer's tensors over ``raw``, uint8 bytes laid out as ``layout`` says, in stored order."""
    views = {}
    for part in layout.parts:
        for spec, offset in part.layout.tensor_offsets:
            views[spec.name] = view_as(raw, part.base + offset, spec)
    return {spec.name: views[spec.name] for spec in layout.tensors}


def _hooked(key: str, tensors: Tensors, hook: LayerHook) -> Tensors:
    """What ``layer_hook`` makes of the layer: its result, checked, or the layer itself for None."""
    result = hook(key, tensors)
    if result is None:
        return tensors
    if not isinstance(result, Mapping):
        raise OptionError(
            f"layer_hook returned {type(result).__name__} for layer {key!r}; it must return a mapping of names to "
            "tensors, or None"
        )
    for name, tensor in result.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise OptionError(
                f"layer_hook returned {type(name).__name__} -> {type(tensor).__name__} for layer {key!r}; "
                f"it must map tensor names (str) to tensors"
            )
    return dict(result)
