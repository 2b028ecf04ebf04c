"""The source interface: a readable object, the store that lists and opens them, and the capabilities a store may
declare beyond reading (:class:`Mapped`, :class:`SharedMemory`, :class:`DirectIO`), checked with ``isinstance``.

Example:
    >>> from weightstream.sources.local.file import LocalStore
    >>> isinstance(LocalStore(), Mapped), isinstance(LocalStore(), DirectIO), isinstance(LocalStore(), SharedMemory)
    (True, True, False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

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

    def verify_whole(self, held: memoryview | None = None) -> None:
        """Check everything the source's integrity depends on, reading what was not read; ``held``: the source's
        bytes as the caller holds them, some not read through the source (from a fleet's peers): checked too.

        Raises:
            IntegrityError: it does not match.
        """


@runtime_checkable
class KnownDigest(Protocol):
    """A source whose origin states the sha256 of its whole content (an S3 object uploaded with a SHA-256 checksum):
    the node cache checks a file its fleet filled against it."""

    whole_sha256: str | None
    """Hex sha256 of the object's bytes, or None where the origin gave none (or only a per-part one)."""


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


class MappedBytes(Protocol):
    """A whole file's bytes in this process's memory, read-only to it."""

    bytes: torch.Tensor
    """The file's bytes, ``uint8``, on the CPU."""

    def verify_unchanged(self) -> None:
        """Raise :class:`SourceChangedError` if the file is no longer the version mapped."""

    def close(self) -> None:
        """Let go of the mapping (views of it keep it alive); idempotent."""


class SharedBytes(MappedBytes, Protocol):
    """A file's bytes shared by another process, which may also hold a read-only copy of them on a GPU."""

    def device_bytes(self, device: torch.device) -> torch.Tensor:
        """A view of the copy on ``device`` (``DeviceUnavailableError`` where there is none)."""


@runtime_checkable
class Mapped(Protocol):
    """A store whose files can be mapped whole (``zero_copy``: tensors are views of them)."""

    def mapped(self, uri: str, size: int, version: str | None) -> MappedBytes:
        """``uri``, checked to be the file of ``size`` bytes and ``version`` planned, mapped."""


@runtime_checkable
class SharedMemory(Protocol):
    """A store whose files are memory another process filled and shares read-only (the node cache): views of them
    cost no copy, on the CPU and, where it holds device copies, on a GPU."""

    def shared(self, uri: str, size: int, version: str | None) -> SharedBytes:
        """``uri``'s shared bytes, checked to be the file of ``size`` bytes and ``version`` planned."""


@runtime_checkable
class DirectIO(Protocol):
    """A store of local files, which reads may reach around the page cache: ``O_DIRECT``, and cuFile (GPUDirect
    Storage) straight to a GPU."""

    def direct_path(self, uri: str) -> str:
        """The path of ``uri`` on this machine, for a reader that opens it itself (cuFile)."""


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
