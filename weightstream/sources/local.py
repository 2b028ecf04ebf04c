"""Local files: ``os.preadv`` straight into the caller's memory."""

from __future__ import annotations

import os

from weightstream.errors import NotFound, SourceError, TruncatedFileError


class LocalFile:
    """An open local file. Thread-safe: reads are positional."""

    def __init__(self, path: str) -> None:
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"{path}: no such file") from None
        except OSError as error:
            raise SourceError(f"{path}: cannot open: {error.strerror}") from None
        self.uri = path
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        done, wanted = 0, len(buffer)
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

    def is_dir(self, uri: str) -> bool:
        return os.path.isdir(_path(uri))

    def exists(self, uri: str) -> bool:
        return os.path.exists(_path(uri))

    def list_names(self, uri: str) -> list[str]:
        return sorted(os.listdir(_path(uri)))

    def join(self, directory: str, name: str) -> str:
        return os.path.join(_path(directory), name)

    def open(self, uri: str) -> LocalFile:
        return LocalFile(_path(uri))


def _path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri
