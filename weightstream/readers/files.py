"""The open files of one load: each opened, and checked against its plan, when a read first needs it,
and at most a few more open at once than the load has reader threads.

A sharded state of 1,100 small files, each held open for the whole load, ran out of the default
1,024 descriptors. Here an idle file (no read in flight) is closed, least recently used first, when
another must open, and checked unchanged as it closes; reads of it later open it again, pinned to
the same version. The readers see one :class:`PooledSource` per file and never an open or a close.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import torch
from typing_extensions import Self

from weightstream.options import LoadOptions
from weightstream.planning.plan import FileSpec
from weightstream.sources.base import Source, Store, check_unchanged

SPARE_FILES = 4
"""Files kept open beyond one per reader thread."""


class FileHandles:
    """The load's files, opened on demand; a context manager that closes them all at its end.

    On a normal end every file still open is checked unchanged (a local file written in place while
    it was read raises :class:`SourceChangedError`); on an error they are closed unchecked.

    Example:
        >>> with FileHandles(store, opts) as files:  # doctest: +SKIP
        ...     source = files.source(plan.files[0])
        ...     source.read_into(0, memoryview(bytearray(8)))
    """

    def __init__(self, store: Store, opts: LoadOptions) -> None:
        self.store = store
        self.opts = opts
        self.limit = opts.reader_threads + SPARE_FILES
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[str, list] = collections.OrderedDict()
        """path -> [source, reads in flight], least recently used first."""

    def source(self, spec: FileSpec) -> PooledSource:
        """The source the readers use for ``spec``'s file: how it reads (direct or not) is settled now, and
        while fewer than the limit are open the file is opened (and checked against the plan) now too, so a
        file changed since the plan fails the load before its first tensor."""
        pooled = PooledSource(self, spec, self.store.resolve_direct(spec.path, self.opts.direct_io))
        with self._lock:
            if len(self._open) < self.limit and spec.path not in self._open:
                self._open[spec.path] = [self._open_checked(pooled), 0]
        return pooled

    @contextlib.contextmanager
    def use(self, pooled: PooledSource) -> Iterator[Source]:
        """The open source of ``pooled``'s file for one read (opening it, and closing an idle one, if need be)."""
        with self._lock:
            entry = self._open.get(pooled.uri)
            if entry is None:
                self._close_idle()
                entry = self._open[pooled.uri] = [self._open_checked(pooled), 0]
            self._open.move_to_end(pooled.uri)
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        with self._lock:
            entries, self._open = list(self._open.values()), collections.OrderedDict()
        with contextlib.ExitStack() as closing:
            for source, _ in entries:
                closing.callback(source.close)
            if kind is None:
                for source, _ in entries:
                    source.verify_unchanged()

    def _open_checked(self, pooled: PooledSource) -> Source:
        """The file opened at its planned version: the store checks it (a local file's size and identity at
        open; an object's every answer). A plan without a version can only be checked for its size here."""
        spec = pooled.spec
        if spec.version is not None:
            return self.store.open_pinned(spec.path, spec.size, spec.version, direct=pooled.direct)
        source = self.store.open(spec.path, direct=pooled.direct)
        try:
            check_unchanged(spec.path, spec.size, source.size)
        except BaseException:
            source.close()
            raise
        return source

    def _close_idle(self) -> None:
        """Below the limit again by closing idle files, least recently used first (each checked unchanged)."""
        for path in [path for path, (_, reads) in self._open.items() if reads == 0]:
            if len(self._open) < self.limit:
                return
            source, _ = self._open.pop(path)
            try:
                source.verify_unchanged()
            finally:
                source.close()


class PooledSource:
    """One file of the load as the readers see it: a :class:`Source` whose reads borrow the open file
    from the load's :class:`FileHandles`."""

    def __init__(self, files: FileHandles, spec: FileSpec, direct: bool) -> None:
        self._files = files
        self.spec = spec
        self.uri = spec.path
        self.size = spec.size
        self.version = spec.version
        self.direct = direct

    def read(self, offset: int, nbytes: int) -> bytes:
        with self._files.use(self) as source:
            return source.read(offset, nbytes)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        with self._files.use(self) as source:
            source.read_into(offset, buffer)

    @property
    def copy_source(self) -> torch.Tensor | None:
        """The open file's memory a copy engine reads directly, if it has any (the node cache's segments, for a
        CUDA load); it stays valid after the file closes."""
        with self._files.use(self) as source:
            return getattr(source, "copy_source", None)

    def verify_unchanged(self) -> None:
        """Checked by :class:`FileHandles` as the file closes."""

    def close(self) -> None:
        """Closed by :class:`FileHandles`."""
