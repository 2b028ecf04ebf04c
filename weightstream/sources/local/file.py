"""Local files: ``os.preadv`` straight into the caller's memory, buffered or direct (O_DIRECT).

Direct reads skip the page cache: a cold load then pays for one fresh page per byte (the
destination) instead of two (a page-cache page and the destination), and the device sees
the whole queue of requests at once. A warm file is read buffered, from the page cache.

Every file is pinned like an object in a store: its version is its identity (device, inode and
modification time, with its size beside it) when its header was read. A file opened for the
reads must still be that file, and still be unchanged when its reads are done; one replaced
(``os.replace``) or rewritten in place between the plan and the reads raises
:class:`SourceChangedError`, never a splice of two files. Only regular files are opened (a FIFO
would block the plan forever; a device is no checkpoint). Symbolic links are followed: the
Hugging Face cache links every snapshot file into its blob store.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Literal

from typing_extensions import Self

from weightstream.errors import SourceError, TruncatedFileError, UnsupportedInputError, logger
from weightstream.sources.local.identity import check_identity, identity
from weightstream.sources.local.mapped import MappedFile
from weightstream.sources.local.pagecache import fd_resident_fraction, resident_fraction
from weightstream.sources.local.regular import open_regular

log = logger(__name__)

DIRECT_ALIGNMENT = 4096
"""Offsets, lengths and memory of direct reads are multiples of this (any block size divides it)."""
DIRECT_BELOW_RESIDENCY = 0.5
"""With ``direct="auto"``, a file less than this fraction in the page cache is read directly."""

DirectMode = bool | Literal["auto"]


class LocalFile:
    """An open local file. Thread-safe: reads are positional.

    With ``direct=True`` the file is opened with O_DIRECT: every read must then be aligned
    to :data:`DIRECT_ALIGNMENT` in offset, length and memory.
    """

    def __init__(self, path: str, *, direct: bool = False) -> None:
        self._fd, status = open_regular(path, os.O_DIRECT if direct else 0)
        self.uri = path
        self.direct = direct
        self.size = status.st_size
        self.version = identity(status)
        """Device, inode and modification time when opened: what the reads are pinned to."""

    @classmethod
    def from_descriptor(cls, fd: int, name: str, *, direct: DirectMode = False) -> LocalFile:
        """The file open at ``fd``, which the result takes over (and closes, even when this raises): what a process
        that may not open ``name`` itself reads when another process opened it and passed it over (the node cache
        daemon reads what its clients open). ``name`` is for messages only. ``direct="auto"`` reads it directly
        when it is mostly not in the page cache and its filesystem allows it.

        Raises:
            UnsupportedInputError: ``fd`` is not a regular file open for reading.

        Example:
            >>> source = LocalFile.from_descriptor(os.open("/etc/hostname", os.O_RDONLY), "/etc/hostname")
            >>> source.size == os.stat("/etc/hostname").st_size
            True
            >>> source.close()
        """
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise UnsupportedInputError(f"{name}: the descriptor passed is not of a regular file")
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            # O_PATH needs no read permission: its descriptor proves nothing of what its holder may read.
            if flags & os.O_ACCMODE == os.O_WRONLY or flags & os.O_PATH:
                raise UnsupportedInputError(f"{name}: the descriptor passed is not open for reading")
            try:
                os.pread(fd, 1, 0)
            except OSError as error:
                raise UnsupportedInputError(f"{name}: the descriptor passed cannot be read: {error.strerror}") from None
            wanted = (
                direct
                if direct != "auto"
                else fd_resident_fraction(fd, status.st_size, name, sampled=True) < DIRECT_BELOW_RESIDENCY
            )
            if bool(wanted) != bool(flags & os.O_DIRECT):
                try:
                    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if wanted else (flags & ~os.O_DIRECT))
                except OSError as error:
                    if direct is True:
                        raise SourceError(f"{name}: cannot read with O_DIRECT: {error.strerror}") from error
                    wanted = False  # the filesystem refuses O_DIRECT: through the page cache
        except BaseException:
            os.close(fd)
            raise
        source = cls.__new__(cls)
        source._fd, source.uri, source.direct = fd, name, bool(wanted)
        source.size, source.version = status.st_size, identity(status)
        return source

    def read(self, offset: int, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def verify_unchanged(self) -> None:
        """Raise :class:`SourceChangedError` if the file was written (or truncated) since it was opened."""
        check_identity(self.uri, self.size, self.version, os.fstat(self._fd))

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset``. Bytes past the size the file had when opened are not
        read (only aligned direct reads ask for them); any other shortfall raises."""
        done, wanted = 0, min(len(buffer), self.size - offset)
        while done < wanted:
            try:
                got = os.preadv(self._fd, [buffer[done:]], offset + done)
            except OSError as error:
                failure = SourceError(
                    f"{self.uri}: read of bytes {offset}..{offset + wanted} failed at byte {offset + done}: "
                    f"{error.strerror}"
                )
                failure.errno = error.errno
                raise failure from error
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

    def __enter__(self) -> Self:
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

    def direct_path(self, uri: str) -> str:
        """The path ``uri`` names (a ``file://`` URI's path)."""
        return _path(uri)

    def mapped(self, uri: str, size: int, version: str | None) -> MappedFile:
        """A private mapping of ``uri``, checked to be the file of ``size`` bytes and ``version`` planned."""
        return MappedFile(_path(uri), size, version)

    def open_pinned(self, uri: str, size: int, version: str, *, direct: DirectMode = False) -> LocalFile:
        """Open ``uri`` as :meth:`open` does, and check it is still the file of ``size`` bytes and ``version``
        planned."""
        source = self.open(uri, direct=direct)
        try:
            check_identity(source.uri, size, version, os.fstat(source._fd))
        except BaseException:
            source.close()
            raise
        return source

    def open(self, uri: str, *, direct: DirectMode = False) -> LocalFile:
        """Open ``uri``; ``direct="auto"`` reads directly when the file is mostly not in the page cache."""
        return LocalFile(_path(uri), direct=self.resolve_direct(uri, direct))

    def resolve_direct(self, uri: str, direct: DirectMode) -> bool:
        """Whether reads of ``uri`` go around the page cache: ``direct`` itself, or for ``"auto"`` whether
        the file is mostly not in the page cache (``mincore``) and its filesystem allows O_DIRECT."""
        if direct != "auto":
            return bool(direct)
        path = _path(uri)
        if resident_fraction(path, sampled=True) >= DIRECT_BELOW_RESIDENCY:
            return False
        try:
            fd, _ = open_regular(path, os.O_DIRECT)
        except SourceError as error:
            if not isinstance(error.__cause__, OSError) or error.__cause__.errno != errno.EINVAL:
                raise
            log.info("%s: the filesystem refuses O_DIRECT; reading through the page cache", path)
            return False
        os.close(fd)
        return True


def _path(uri: str) -> str:
    return uri.removeprefix("file://")
