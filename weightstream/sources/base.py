"""The source interface: a readable object and the store that lists and opens them."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from weightstream.errors import SourceChangedError


class Source(Protocol):
    """One open, readable object of a known size (a file, an object-store key)."""

    uri: str
    size: int
    version: str | None
    """The version reads are pinned to (an S3 ETag, a GCS generation, a local file's
    ``dev:inode:mtime_ns:ctime_ns``)."""

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` from ``offset`` (small reads: headers, indexes)."""

    direct: bool
    """Whether reads must be aligned to ``DIRECT_ALIGNMENT`` (and may extend past the end of the file)."""

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes from ``offset``, or raise; never a short read
        (except past the end of the file, for aligned direct reads)."""

    def verify_unchanged(self) -> None:
        """After the reads: raise :class:`SourceChangedError` if the object is no longer the version read
        (a local file written in place); a no-op where every answer was checked as it came."""

    def close(self) -> None:
        """Release the descriptor or connection; idempotent."""


@runtime_checkable
class CheckedWhole(Protocol):
    """A source whose integrity check covers more than its own bytes (an OCI blob holding it with other files) and
    can be completed on demand: the node cache calls :meth:`verify_whole` before it publishes the file."""

    def verify_whole(self) -> None:
        """Check everything the source's integrity depends on, reading what was not read.

        Raises:
            IntegrityError: it does not match.
        """


class Store(Protocol):
    """Lists and opens objects under one kind of URI."""

    def is_dir(self, uri: str) -> bool:
        """Whether ``uri`` names a directory (or prefix)."""

    def exists(self, uri: str) -> bool:
        """Whether ``uri`` names a file or a directory."""

    lists: bool
    """Whether :meth:`list_names` works (HTTP has no listing: files there are found by name)."""

    def list_names(self, uri: str) -> list[str]:
        """Names of the entries directly inside directory ``uri``, sorted."""

    def join(self, directory: str, name: str) -> str:
        """The URI of ``name`` inside ``directory``."""

    def open(self, uri: str, *, direct: bool | str = False) -> Source:
        """Open ``uri`` for reading; ``direct`` is ``True``, ``False`` or ``"auto"`` (see ``LoadOptions.direct_io``)."""

    def resolve_direct(self, uri: str, direct: bool | str) -> bool:
        """Whether reads of ``uri`` will go around the page cache, for ``direct`` (``True``, ``False`` or
        ``"auto"``)."""

    def open_pinned(self, uri: str, size: int, version: str, *, direct: bool | str = False) -> Source:
        """``uri`` at ``version`` (of ``size`` bytes): an object without asking the store again, every read
        pinned to it, so a replaced object fails its first read; a local file checked to be the one planned
        (:class:`SourceChangedError` either way)."""

    def close(self) -> None:
        """Release connections the store holds; idempotent."""


def check_unchanged(
    uri: str, planned_size: int, size_now: int, planned_version: str | None = None, version_now: str | None = None
) -> None:
    """Raise if an object's size (or version) differs from what its header was planned with."""
    if size_now != planned_size:
        raise SourceChangedError(
            f"{uri}: is {size_now} bytes now, {planned_size} when its header was read (it changed while loading)"
        )
    if version_now != planned_version:
        raise SourceChangedError(
            f"{uri}: is version {version_now} now, {planned_version} when its header was read (it changed while "
            "loading)"
        )
