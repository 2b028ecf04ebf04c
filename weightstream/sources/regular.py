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
