"""A checkpoint opened once: its plan, its store, and every read made through them.

:func:`weightstream.open` checks the options, picks the loader, opens one store and reads the headers; the
:class:`Checkpoint` it returns reads tensors, slices, layers or everything through that store, that plan (the files it
read the headers of, pinned to the versions it saw) and that loader, until it is closed. ``load_weights``,
``iter_weights`` and ``iter_layers`` are this, in one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from typing_extensions import Self

from weightstream.checkpoint.reads import TrackedReads, layer_items, weight_items
from weightstream.checkpoint.slices import TensorSlice
from weightstream.errors import CheckpointClosedError, HeaderError, InvalidOptionError, TensorNotFound
from weightstream.loaders.base import Loader
from weightstream.memory.devices import check_fits
from weightstream.options import LoadOptions, changed_fields
from weightstream.planning.plan import LoadPlan, TensorSpec
from weightstream.registry import bind_options, get_loader
from weightstream.sources import Store

Item = TypeVar("Item")


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
    cache: dict[str, object] = dataclasses.field(default_factory=dict)
    """Whether it read through the node cache: ``{}`` where no ``cache=`` was asked for; ``{"used": True, "hit": N,
    "filled": M}`` (files the daemon held, and files it read for this checkpoint); ``{"used": False, "why": ...}``
    where ``cache="auto"`` found no daemon it could use."""
    copy_routes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Through the node cache to a GPU: files by where their copies read, ``device-copy`` (the daemon's copy on
    that GPU), ``page-locked`` (host segments locked in place) or ``staging-ring`` (a driver that cannot lock
    read-only memory). Empty for other loads."""


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

    def __init__(
        self,
        loader: Loader,
        store: Store,
        plan: LoadPlan,
        opts: LoadOptions,
        plan_seconds: float,
        cache_not_used: str | None = None,
    ) -> None:
        self._loader = loader
        self._store = store
        self._plan = plan
        self._opts = opts
        self._by_name = {spec.name: spec for spec in plan.tensors}
        self._closed = False
        self._lock = threading.Lock()
        self._reads: weakref.WeakSet[TrackedReads[Any]] = weakref.WeakSet()
        self._stats = CheckpointStats(plan_seconds=plan_seconds)
        self._finalizer = weakref.finalize(self, _close_quietly, store)
        self._cache_not_used = cache_not_used

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
        from weightstream.nodecache.client import CachedStore

        with self._lock:
            done = dataclasses.replace(self._stats)
        if isinstance(self._store, CachedStore):
            done.copy_routes = self._store.copy_routes()
            done.cache = {"used": True, **self._store.attached()}
        elif self._opts.cache is not None:
            done.cache = {"used": False, "why": self._cache_not_used or "no daemon"}
        return done

    @property
    def closed(self) -> bool:
        return self._closed

    def keys(self) -> list[str]:
        """The selected tensors' names, in stored order (file by file, by offset).

        Raises:
            CheckpointClosedError: after ``close()``, as ``get_tensor`` (and safetensors' ``keys``).
        """
        self._check_open()
        return list(self._by_name)

    def __contains__(self, name: object) -> bool:
        self._check_open()
        return name in self._by_name

    def metadata(self, path: str | None = None) -> dict[str, str]:
        """The ``__metadata__`` of the file ``path`` (as in ``plan.files``), or of every file where they agree.

        Raises:
            HeaderError: two files give one key different values (pass ``path``).
            TensorNotFound: ``path`` is not a file of the plan.
            CheckpointClosedError: after ``close()``.
        """
        self._check_open()
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
        found = self._read_part((self._spec(name),), self._kept_options())
        if name not in found:
            raise TensorNotFound(
                f"{self.uri}: the layer_hook did not return tensor {name!r} (it returned {sorted(found)[:4]})"
            )
        return found[name]

    def get_slice(self, name: str) -> TensorSlice:
        """A view of one stored tensor whose ``[index]`` reads only the bytes the index selects, through the loader
        the checkpoint was opened with (with ``distributed``, ``[index]`` is a collective, as :meth:`get_tensor`).

        Example:
            >>> rows = checkpoint.get_slice("model.embed_tokens.weight")[1000:2000]  # doctest: +SKIP
        """
        if getattr(self._opts.loader_options, "verify", False):
            raise InvalidOptionError(
                f"verify=True checks whole tensors against their checksums; {name!r}[...] reads part of one"
            )
        return TensorSlice(self, self._spec(name))

    def iter_weights(self) -> TrackedReads[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every selected tensor, as the loader reads them (see
        :func:`weightstream.iter_weights`)."""
        self._check_open()
        return self._track(self._loader.iter_weights(self._store, self._plan, self._opts), weight_items)

    def iter_layers(self) -> TrackedReads[tuple[str, dict[str, torch.Tensor]]]:
        """Yield ``(layer key, {name: tensor})`` layer by layer through reused buffers (see
        :func:`weightstream.iter_layers`).

        A checkpoint opened with another format reads its plan through the ``layered`` loader.

        Raises:
            InvalidOptionError: an option the ``layered`` loader cannot honour (``zero_copy``, ...).
        """
        self._check_open()
        if hasattr(self._loader, "iter_layers"):
            return self._track(self._loader.iter_layers(self._store, self._plan, self._opts), layer_items)
        set_options = changed_fields(self._opts.loader_options) if self._opts.loader_options is not None else []
        if set_options:
            raise InvalidOptionError(
                f"{set_options[0]}: an option of format={self.format!r}; iter_layers reads through the layered loader, "
                "which does not use it"
            )
        layered = get_loader("layered")
        opts = bind_options(layered, self._opts, {})
        layered.check(opts)
        return self._track(layered.iter_layers(self._store, self._plan, opts), layer_items)  # type: ignore[attr-defined]

    def load(self) -> dict[str, torch.Tensor]:
        """Every selected tensor, in stored order: all of them, or an error and none (see
        :func:`weightstream.load_weights`)."""
        self._check_open()
        opts = self._kept_options()
        check_fits(self._plan.total_bytes, opts.device, self.uri)  # readers may hold a window; the dict keeps it all
        return self._in_stored_order(self._read_part(self._plan.tensors, opts))

    def close(self) -> None:
        """Stop every iterator this checkpoint returned and close its store; idempotent."""
        with self._lock:
            self._closed = True
            reads = list(self._reads)
        for read in reads:
            read.close()
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

    def _read_part(
        self, tensors: tuple[TensorSpec, ...], opts: LoadOptions, counted: bool = True
    ) -> dict[str, torch.Tensor]:
        """``tensors`` (of the plan, or pieces of them) read through the loader with ``opts``: all, or an error.
        Counted in the stats unless the caller counts them itself (``counted=False``: a slice's pieces)."""
        part = dataclasses.replace(self._plan, tensors=tensors)
        found: dict[str, torch.Tensor] = {}
        try:
            reads = self._track(self._loader.iter_weights(self._store, part, opts), weight_items if counted else None)
            with contextlib.closing(reads):
                found.update(reads)
        except BaseException:
            found.clear()  # a traceback keeps this frame alive; the memory must not wait for it
            raise
        return found

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointClosedError(f"{self.uri}: the checkpoint is closed")

    def _track(self, iterator: Iterator[Item], count: Callable[[Item], tuple[int, int]] | None) -> TrackedReads[Item]:
        reads = TrackedReads(self, iterator, count)
        with self._lock:
            if self._closed:
                reads.close()
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


def _close_quietly(store: Store) -> None:
    with contextlib.suppress(Exception):  # at garbage collection there is nobody to tell
        store.close()
