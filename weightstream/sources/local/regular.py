"""Opening local files that are regular files, and nothing else."""

from __future__ import annotations

import fcntl
import os
import stat

from weightstream.errors import NotFound, SourceError, UnsupportedInputError


def open_regular(path: str, flags: int = 0) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` (with extra ``flags``) and its status, if it is a regular file.

    Opened non-blocking, then checked, so that a FIFO (or a device) is refused at once instead of
    blocking ``open`` until a writer appears.

    Example:
        >>> open_regular("/dev/null")
        Traceback (most recent call last):
        ...
        weightstream.errors.UnsupportedInputError: /dev/null: is a character device, not a regular file; ...
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
    except FileNotFoundError:
        raise NotFound(f"{path}: no such file") from None
    except OSError as error:
        failure = SourceError(f"{path}: cannot open{' with O_DIRECT' if flags & os.O_DIRECT else ''}: {error.strerror}")
        failure.errno = error.errno
        raise failure from error
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise UnsupportedInputError(
                f"{path}: is a {_kind(status.st_mode)}, not a regular file; weightstream reads regular files only"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, status


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them: every small file weightstream reads for a
    user (a Hub ref, an index, a token, a Docker config, a model's ``config.json``) goes through here, so a FIFO or
    a device in its place is refused at once instead of blocking a read forever.

    Raises:
        NotFound: no such file. UnsupportedInputError: not a regular file, or over ``limit`` bytes.
        SourceError: it cannot be opened or read (its ``errno`` kept: a permission, a loop of links).

    Example:
        >>> read_regular("/dev/zero", 16)
        Traceback (most recent call last):
        ...
        weightstream.errors.UnsupportedInputError: /dev/zero: is a character device, not a regular file; ...
    """
    fd, status = open_regular(path)
    try:
        if status.st_size > limit:
            raise UnsupportedInputError(
                f"{path}: {status.st_size} bytes, more than the {limit} a file of its kind holds"
            )
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as error:
        failure = SourceError(f"{path}: cannot read: {error.strerror}")
        failure.errno = error.errno
        raise failure from error
    finally:
        os.close(fd)
    if size > limit:
        raise UnsupportedInputError(f"{path}: more than the {limit} bytes a file of its kind holds")
    return b"".join(chunks)


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    ):
        if test(mode):
            return kind
    return "special file"
