"""Local files: ``os.preadv`` straight into the caller's memory, buffered or direct (O_DIRECT).

Direct reads skip the page cache: a cold load then pays for one fresh page per byte (the
destination) instead of two (a page-cache page and the destination), and the device sees
the whole queue of requests at once. A warm file is read buffered, from the page cache.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Literal, Union

from weightstream.errors import NotFound, SourceError, TruncatedFileError
from weightstream.sources.pagecache import resident_fraction

log = logging.getLogger(__name__)

DIRECT_ALIGNMENT = 4096
"""Offsets, lengths and memory of direct reads are multiples of this (any block size divides it)."""
DIRECT_BELOW_RESIDENCY = 0.5
"""With ``direct="auto"``, a file less than this fraction in the page cache is read directly."""

DirectMode = Union[bool, Literal["auto"]]


class LocalFile:
    """An open local file. Thread-safe: reads are positional.

    With ``direct=True`` the file is opened with O_DIRECT: every read must then be aligned
    to :data:`DIRECT_ALIGNMENT` in offset, length and memory.
    """

    def __init__(self, path: str, *, direct: bool = False) -> None:
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            self._fd = os.open(path, flags)
        except FileNotFoundError:
            raise NotFound(f"{path}: no such file") from None
        except OSError as error:
            raise SourceError(f"{path}: cannot open{' with O_DIRECT' if direct else ''}: {error.strerror}") from error
        self.uri = path
        self.direct = direct
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    version = None
    """Local files are not versioned: size and the header are what a load checks."""

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset``. Bytes past the size the file had when opened are not
        read (only aligned direct reads ask for them); any other shortfall raises."""
        done, wanted = 0, min(len(buffer), self.size - offset)
        while done < wanted:
            try:
                got = os.preadv(self._fd, [buffer[done:]], offset + done)
            except OSError as error:
                raise SourceError(
                    f"{self.uri}: read of bytes {offset}..{offset + wanted} failed at byte {offset + done}: {error.strerror}"
                ) from None
            if got == 0:
                raise TruncatedFileError(
                    f"{self.uri}: file ends at byte {offset + done}, expected bytes up to {offset + wanted} "
                    f"(it changed or shrank while loading)"
                )
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class LocalStore:
    """Paths on the local filesystem (``file://`` prefix accepted)."""

    lists = True

    def is_dir(self, uri: str) -> bool:
        return os.path.isdir(_path(uri))

    def exists(self, uri: str) -> bool:
        return os.path.exists(_path(uri))

    def list_names(self, uri: str) -> list[str]:
        return sorted(os.listdir(_path(uri)))

    def join(self, directory: str, name: str) -> str:
        return os.path.join(_path(directory), name)

    def close(self) -> None:
        """Nothing to release: each file is closed by its reader."""

    def open(self, uri: str, *, direct: DirectMode = False) -> LocalFile:
        """Open ``uri``; ``direct="auto"`` reads directly when the file is mostly not in the page cache."""
        path = _path(uri)
        if direct != "auto":
            return LocalFile(path, direct=bool(direct))
        if resident_fraction(path) >= DIRECT_BELOW_RESIDENCY:
            return LocalFile(path)
        try:
            return LocalFile(path, direct=True)
        except SourceError as error:
            if not isinstance(error.__cause__, OSError) or error.__cause__.errno != errno.EINVAL:
                raise
            log.info("%s: the filesystem refuses O_DIRECT; reading through the page cache", path)
            return LocalFile(path)


def _path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri
