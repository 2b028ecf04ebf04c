"""A checkpoint opened once: its plan, its store, and every read made through them.

:func:`open` checks the options, picks the loader, opens one store and reads the headers; the
:class:`Checkpoint` it returns reads tensors, slices, layers or everything through that store
and that plan (the files it read the headers of, pinned to the versions it saw), until it is
closed. ``load_weights``, ``iter_weights`` and ``iter_layers`` are this, in one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
from typing_extensions import Self

from weightstream.errors import CheckpointClosedError, HeaderError, InvalidOptionError, OptionError, TensorNotFound
from weightstream.formats.safetensors import DTYPE_NAMES
from weightstream.loaders.base import Loader
from weightstream.options import LoadOptions, changed_fields
from weightstream.planning.plan import LoadPlan, TensorSpec
from weightstream.planning.slices import plan_slice
from weightstream.registry import AUTO, bind_options, check_options, get_loader
from weightstream.sources import REMOTE_SCHEMES, Store, locate
from weightstream.sources.base import SharedMemory

LOCAL_RUN_COST_BYTES = 64 << 10
"""A slice reads up to this many unwanted bytes of a local file to save one positional read."""
REMOTE_RUN_COST_BYTES = 1 << 20
"""The same for an object: a range request costs about a millisecond, a megabyte at object-store speeds."""

Item = TypeVar("Item")
Opened = TypeVar("Opened", bound="Checkpoint")


def resolve_format(uri: str) -> str:
    """The format ``format="auto"`` picks for ``uri``.

    Object-store URIs (``s3://``, ``gs://``, ``http(s)://``) resolve to ``"streaming"``
    (bounded memory, completion order), local paths to ``"safetensors"``. Either reads one
    ``.safetensors`` file, a directory (or prefix) with ``model.safetensors.index.json``, or
    one of ``*.safetensors`` files. (Pickle files are refused by the loader.) An ``hf://`` model id
    is resolved first: the Hugging Face cache's snapshot is local, the Hub is remote.

    Example:
        >>> resolve_format("model.safetensors"), resolve_format("s3://bucket/llama/")
        ('safetensors', 'streaming')
    """
    return "streaming" if uri.startswith(REMOTE_SCHEMES) else "safetensors"


@dataclasses.dataclass
class CheckpointStats:
    """What a :class:`Checkpoint` has done so far."""

    plan_seconds: float = 0.0
    """Opening the store and reading the headers."""
    tensors: int = 0
    """Tensors (and slices) handed out."""
    tensor_bytes: int = 0
    """Their bytes."""
    read_bytes: int = 0
    """Bytes of the checkpoint read for them: ``tensor_bytes``, and what slices read between their elements."""
    wait_seconds: float = 0.0
    """Time callers spent waiting for tensors (inside ``get_tensor``, ``get_slice`` and the iterators)."""


def open(uri: str | os.PathLike[str], format: str = AUTO, **options: object) -> Checkpoint:
    """Open the checkpoint at ``uri``: options checked, loader picked, headers read, no tensor data yet.

    Use it as a context manager (or call ``close()``): the checkpoint holds its store (and, for an
    object store, its connections) until then. Garbage collection closes it too.

    Raises:
        OptionError: an unknown option, before any I/O.
        WeightstreamError: any other failure, typed (see ``weightstream.errors``).

    Example:
        >>> with weightstream.open("model/") as checkpoint:  # doctest: +SKIP
        ...     embed = checkpoint.get_tensor("model.embed_tokens.weight")
        ...     rows = checkpoint.get_slice("lm_head.weight")[:1024]
    """
    started = time.perf_counter()
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise OptionError(f"uri must be a path or a URI string, got {type(uri).__name__}")
    if not isinstance(format, str):
        raise OptionError(f"format must be a string, got {type(format).__name__}")
    opts, own = check_options(format, options)
    chosen = None if format == AUTO else _checked_loader(format, opts, own)
    store, location = locate(uri, opts.storage_options, opts.retry_policy())
    try:
        if opts.cache is not None:
            store = _through_cache(store, opts)
        # Through the node cache a remote checkpoint's bytes are local shared memory: the views of the
        # safetensors loader beat streaming copies of them.
        automatic = "safetensors" if isinstance(store, SharedMemory) else resolve_format(location)
        loader, opts = chosen or _checked_loader(automatic, opts, own)
        plan = loader.plan(store, location, opts)
    except BaseException:
        store.close()
        raise
    return Checkpoint(loader, store, plan, opts, time.perf_counter() - started)


def _through_cache(store: Store, opts: LoadOptions) -> Store:
    """``store`` read through the node cache ``opts.cache`` names (``store`` itself for ``"auto"`` without a daemon)."""
    from weightstream.nodecache.client import CachedStore, connect

    client = connect(str(opts.cache))
    if client is None:
        return store
    copy_sources = None
    if torch.device(opts.device).type == "cuda":
        from weightstream.memory.devices import check_destination
        from weightstream.nodecache.gpu_import import SegmentCopies

        try:
            check_destination(opts.device, opts.pin_memory)
            copy_sources = SegmentCopies(torch.device(opts.device))
        except BaseException:
            client.close()
            raise
    return CachedStore(store, client, opts.storage_options, copy_sources)


def _checked_loader(format: str, opts: LoadOptions, own: Mapping[str, object]) -> tuple[Loader, LoadOptions]:
    """The loader of ``format`` and the options with its own bound, once it accepts them all."""
    loader = get_loader(format)
    opts = bind_options(loader, opts, own)
    loader.check(opts)
    return loader, opts


class Checkpoint:
    """An open checkpoint (see :func:`open`): names, metadata, and reads of any part of it.

    Every read goes through the loader it was opened with (its destination, I/O options and
    checks) and the store and plan made at open: the files read are the ones planned, and a file
    replaced since raises ``SourceChangedError``. ``close()`` (or leaving the ``with`` block)
    stops every iterator it returned: the next step of one raises ``CheckpointClosedError``.

    Example:
        >>> with weightstream.open("model/", device="cuda") as checkpoint:  # doctest: +SKIP
        ...     print(len(checkpoint.keys()), checkpoint.plan.total_bytes)
        ...     for name, tensor in checkpoint.iter_weights():
        ...         model[name].copy_(tensor)
    """

    def __init__(self, loader: Loader, store: Store, plan: LoadPlan, opts: LoadOptions, plan_seconds: float) -> None:
        self._loader = loader
        self._store = store
        self._plan = plan
        self._opts = opts
        self._by_name = {spec.name: spec for spec in plan.tensors}
        self._closed = False
        self._lock = threading.Lock()
        self._reads: weakref.WeakSet[_Reads[Any]] = weakref.WeakSet()
        self._stats = CheckpointStats(plan_seconds=plan_seconds)
        self._finalizer = weakref.finalize(self, _close_quietly, store)

    @property
    def uri(self) -> str:
        """Where the checkpoint is read from: as it was named, except that an ``hf://`` id names the
        Hugging Face cache's snapshot, or the Hub's URL of its commit."""
        return self._plan.uri

    @property
    def format(self) -> str:
        """The loader reading it."""
        return self._loader.name

    @property
    def plan(self) -> LoadPlan:
        """The files and selected tensors, as the headers described them."""
        return self._plan

    @property
    def options(self) -> LoadOptions:
        """The options it was opened with."""
        return self._opts

    @property
    def stats(self) -> CheckpointStats:
        """A copy of what it has done so far."""
        with self._lock:
            return dataclasses.replace(self._stats)

    @property
    def closed(self) -> bool:
        return self._closed

    def keys(self) -> list[str]:
        """The selected tensors' names, in stored order (file by file, by offset)."""
        return list(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def metadata(self, path: str | None = None) -> dict[str, str]:
        """The ``__metadata__`` of the file ``path`` (as in ``plan.files``), or of every file where they agree.

        Raises:
            HeaderError: two files give one key different values (pass ``path``).
            TensorNotFound: ``path`` is not a file of the plan.
        """
        if path is not None:
            for spec in self._plan.files:
                if spec.path == path:
                    return dict(spec.metadata)
            raise TensorNotFound(
                f"{self.uri}: {path!r} is not one of its files ({', '.join(s.path for s in self._plan.files[:3])}, ...)"
            )
        merged: dict[str, str] = {}
        origin: dict[str, str] = {}
        for spec in self._plan.files:
            for key, value in spec.metadata.items():
                if key in merged and merged[key] != value:
                    raise HeaderError(
                        f"{self.uri}: metadata {key!r} is {merged[key]!r} in {origin[key]} and {value!r} in "
                        f"{spec.path}; "
                        f"ask for one file's with metadata(path=...)"
                    )
                merged[key], origin[key] = value, origin.get(key, spec.path)
        return merged

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (only its bytes) to the checkpoint's destination.

        With the ``distributed`` format this is a collective: every rank asks for the same name.

        Raises:
            TensorNotFound: no such (selected) tensor; the message names the closest.
        """
        spec = self._spec(name)
        opts = self._kept_options()
        part = dataclasses.replace(self._plan, tensors=(spec,))
        found: dict[str, torch.Tensor] = {}
        with contextlib.closing(self._track(self._loader.iter_weights(self._store, part, opts))) as reads:
            found.update(reads)
        if name not in found:
            raise TensorNotFound(
                f"{self.uri}: the layer_hook did not return tensor {name!r} (it returned {sorted(found)[:4]})"
            )
        return found[name]

    def get_slice(self, name: str) -> TensorSlice:
        """A view of one stored tensor whose ``[index]`` reads only the bytes the index selects.

        Example:
            >>> rows = checkpoint.get_slice("model.embed_tokens.weight")[1000:2000]  # doctest: +SKIP
        """
        if getattr(self._opts.loader_options, "verify", False):
            raise InvalidOptionError(
                f"verify=True checks whole tensors against their checksums; {name!r}[...] reads part of one"
            )
        return TensorSlice(self, self._spec(name))

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every selected tensor, as the loader reads them (see
        :func:`weightstream.iter_weights`)."""
        return self._iter_weights(owned=False)

    def _iter_weights(self, owned: bool) -> _Reads[tuple[str, torch.Tensor]]:
        self._check_open()
        return self._track(self._loader.iter_weights(self._store, self._plan, self._opts), owned=owned)

    def iter_layers(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Yield ``(layer key, {name: tensor})`` layer by layer through reused buffers (see
        :func:`weightstream.iter_layers`).

        A checkpoint opened with another format reads its plan through the ``layered`` loader.

        Raises:
            InvalidOptionError: an option the ``layered`` loader cannot honour (``zero_copy``, ...).
        """
        return self._iter_layers(owned=False)

    def _iter_layers(self, owned: bool) -> _Reads[tuple[str, dict[str, torch.Tensor]]]:
        self._check_open()
        if hasattr(self._loader, "iter_layers"):
            return self._track(
                self._loader.iter_layers(self._store, self._plan, self._opts), count=_layer_items, owned=owned
            )
        set_options = changed_fields(self._opts.loader_options) if self._opts.loader_options is not None else []
        if set_options:
            raise InvalidOptionError(
                f"{set_options[0]}: an option of format={self.format!r}; iter_layers reads through the layered loader, "
                "which does not use it"
            )
        layered = get_loader("layered")
        opts = bind_options(layered, self._opts, {})
        layered.check(opts)
        return self._track(layered.iter_layers(self._store, self._plan, opts), count=_layer_items, owned=owned)  # type: ignore[attr-defined]

    def load(self) -> dict[str, torch.Tensor]:
        """Every selected tensor, in stored order: all of them, or an error and none (see
        :func:`weightstream.load_weights`)."""
        self._check_open()
        opts = self._kept_options()
        if torch.device(opts.device).type == "cuda":  # the readers hold a window of it; the dict keeps all of it
            from weightstream.memory.devices import check_fits

            check_fits(self._plan.total_bytes, opts.device, self.uri)
        loaded: dict[str, torch.Tensor] = {}
        try:
            with contextlib.closing(self._track(self._loader.iter_weights(self._store, self._plan, opts))) as reads:
                loaded.update(reads)
        except BaseException:
            loaded.clear()  # a traceback keeps this frame alive; the memory must not wait for it
            raise
        return self._in_stored_order(loaded)

    def close(self) -> None:
        """Stop every iterator this checkpoint returned and close its store; idempotent."""
        with self._lock:
            self._closed = True
            reads = list(self._reads)
        for read in reads:
            read.stop()
        self._finalizer()

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._by_name)} tensors, {self._plan.total_bytes} bytes"
        return f"<weightstream.Checkpoint {self.uri!r} format={self.format!r} ({state})>"

    def _kept_options(self) -> LoadOptions:
        """The options of a read whose tensors the caller keeps: a loader that reuses its memory is asked for copies."""
        own = self._opts.loader_options
        if not getattr(self._loader, "reuses_memory", False) or own is None:
            return self._opts
        return dataclasses.replace(self._opts, loader_options=dataclasses.replace(own, copy_layers=True))  # type: ignore[type-var]

    def _spec(self, name: str) -> TensorSpec:
        self._check_open()
        spec = self._by_name.get(name)
        if spec is None:
            close = (
                difflib.get_close_matches(name, self._by_name, n=1)
                if isinstance(name, str) and len(self._by_name) < 100_000
                else []
            )
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TensorNotFound(
                f"{self.uri}: no tensor {name!r} among its {len(self._by_name)} selected tensors{hint}"
            )
        return spec

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointClosedError(f"{self.uri}: the checkpoint is closed")

    def _track(self, iterator: Iterator[Item], count: Any = None, owned: bool = False) -> _Reads[Item]:
        reads = _Reads(self, iterator, count or _weight_item, owned)
        with self._lock:
            if self._closed:
                reads.stop()
                raise CheckpointClosedError(f"{self.uri}: the checkpoint is closed")
            self._reads.add(reads)
        return reads

    def _counted(self, tensors: int, tensor_bytes: int, read_bytes: int, waited: float) -> None:
        with self._lock:
            self._stats.tensors += tensors
            self._stats.tensor_bytes += tensor_bytes
            self._stats.read_bytes += read_bytes
            self._stats.wait_seconds += waited

    def _in_stored_order(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``loaded`` in the plan's order, then what a ``layer_hook`` added (or renamed) in the order it came.

        Without a hook every planned tensor must be there: one missing is a loader's failure, not a result."""
        ordered = {spec.name: loaded[spec.name] for spec in self._plan.tensors if spec.name in loaded}
        if getattr(self._opts.loader_options, "layer_hook", None) is None and len(ordered) < len(self._plan.tensors):
            missing = next(spec.name for spec in self._plan.tensors if spec.name not in loaded)
            raise TensorNotFound(f"{self.uri}: the {self.format} loader ended without yielding tensor {missing!r}")
        ordered.update((name, tensor) for name, tensor in loaded.items() if name not in ordered)
        return ordered


class TensorSlice:
    """One stored tensor, not read yet: ``[index]`` (ints, slices with positive steps, ``...``) reads
    the bytes the index selects and returns them as a new tensor on the checkpoint's destination.
    Rows (a range of dimension 0) are one read; other selections are as few reads as are worth it
    (see ``weightstream.planning.slices``). ``get_shape()`` and ``get_dtype()`` are ``safetensors``'.

    Example:
        >>> head = checkpoint.get_slice("lm_head.weight")  # doctest: +SKIP
        >>> head.shape, head[:, :128].shape  # doctest: +SKIP
        ((128256, 4096), (128256, 128))
    """

    def __init__(self, checkpoint: Checkpoint, spec: TensorSpec) -> None:
        self._checkpoint = checkpoint
        self._spec = spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    def get_shape(self) -> list[int]:
        return list(self._spec.shape)

    def get_dtype(self) -> str:
        return DTYPE_NAMES[self._spec.dtype]

    def __getitem__(self, index: object) -> torch.Tensor:
        checkpoint, spec = self._checkpoint, self._spec
        checkpoint._check_open()
        cost = REMOTE_RUN_COST_BYTES if checkpoint.uri.startswith(REMOTE_SCHEMES) else LOCAL_RUN_COST_BYTES
        planned = plan_slice(spec.shape, spec.dtype.itemsize, index, run_cost_bytes=cost)
        started = time.perf_counter()
        if planned.runs:
            values = (
                _read_runs(checkpoint, spec, planned.runs).view(spec.dtype).reshape(planned.read_shape)[planned.index]
            )
            values = values.clone() if values.untyped_storage().nbytes() > values.nbytes else values.contiguous()
        else:
            values = torch.empty(planned.shape, dtype=spec.dtype)
        result = _to_destination(values, checkpoint.options)
        checkpoint._counted(1, result.nbytes, planned.read_bytes, time.perf_counter() - started)
        return result

    def __repr__(self) -> str:
        return f"<weightstream.TensorSlice {self._spec.name!r} {self.get_dtype()} {list(self._spec.shape)}>"


class _Reads(Generic[Item]):
    """An iterator of a checkpoint's: counts what it hands out, and stops when the checkpoint closes."""

    def __init__(self, checkpoint: Checkpoint, inner: Iterator[Item], count: Any, owned: bool) -> None:
        self._checkpoint = checkpoint
        self._inner = inner
        self._count = count
        self._owned = owned
        """The checkpoint was opened for this iterator alone (``weightstream.iter_weights``): it closes with it."""

    def __iter__(self) -> _Reads[Item]:
        return self

    def __next__(self) -> Item:
        checkpoint = self._checkpoint
        if checkpoint.closed:
            self.stop()
            raise CheckpointClosedError(f"{checkpoint.uri}: the checkpoint was closed while this iterator was open")
        started = time.perf_counter()
        try:
            item = next(self._inner)
        except BaseException:
            if self._owned:
                checkpoint.close()
            raise
        tensors, nbytes = self._count(item)
        checkpoint._counted(tensors, nbytes, nbytes, time.perf_counter() - started)
        if checkpoint.closed:  # closed from another thread during the read
            self.stop()
            raise CheckpointClosedError(f"{checkpoint.uri}: the checkpoint was closed while this iterator was open")
        return item

    def close(self) -> None:
        """Stop reading (as a generator's ``close()``): readers stop, what was not handed out is released."""
        self.stop()
        if self._owned:
            self._checkpoint.close()

    def stop(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):  # running in another thread: it stops at its next step
                close()


def _weight_item(item: tuple[str, torch.Tensor]) -> tuple[int, int]:
    return 1, item[1].nbytes


def _layer_items(item: tuple[str, Mapping[str, torch.Tensor]]) -> tuple[int, int]:
    return len(item[1]), sum(tensor.nbytes for tensor in item[1].values())


def _read_runs(checkpoint: Checkpoint, spec: TensorSpec, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The bytes of ``runs`` (offsets from the tensor's first byte), concatenated, read on the host."""
    from weightstream.readers.destination import Destination, Route
    from weightstream.readers.parallel import read_tensors

    file = next(entry for entry in checkpoint.plan.files if entry.path == spec.file)
    pieces = tuple(
        TensorSpec(
            f"{spec.name}[bytes {offset}:{offset + nbytes}]",
            torch.uint8,
            (nbytes,),
            spec.file,
            spec.offset + offset,
            nbytes,
        )
        for offset, nbytes in runs
    )
    host = dataclasses.replace(checkpoint.options, device="cpu", pin_memory=False, zero_copy=False, gds=False)
    plan = LoadPlan(checkpoint.uri, (file,), pieces)
    read: dict[str, torch.Tensor] = {}
    with contextlib.closing(
        read_tensors(checkpoint._store, plan, host, Destination(Route.HOST, torch.device("cpu")))
    ) as tensors:
        read.update(tensors)
    ordered = [read[piece.name] for piece in pieces]
    joined = ordered[0] if len(ordered) == 1 else torch.cat(ordered)
    # A tensor stored at an offset that is no multiple of its element size (a writer may put one there) is viewed
    # from an aligned copy: torch views a dtype only at a storage offset its element size divides.
    return joined.clone() if joined.storage_offset() % spec.dtype.itemsize else joined


def _to_destination(values: torch.Tensor, opts: LoadOptions) -> torch.Tensor:
    from weightstream.memory.devices import check_destination

    if torch.device(opts.device).type == "cuda":
        return values.to(opts.device)
    return values.pin_memory() if check_destination(opts.device, opts.pin_memory) else values


def _close_quietly(store: Store) -> None:
    with contextlib.suppress(Exception):  # at garbage collection there is nobody to tell
        store.close()
