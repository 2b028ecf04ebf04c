"""A local file's version: what it is pinned to from its plan to its last read (device, inode, modification and
change times, beside its size), and the check that it is still that file."""

from __future__ import annotations

import os

from weightstream.errors import SourceChangedError


def identity(status: os.stat_result) -> str:
    """A local file's version: ``dev:inode:mtime_ns:ctime_ns`` (its size is checked beside it). The change time is
    there because a writer can set the modification time back (``os.utime``) but never the change time: a file
    rewritten in place at the same size, its mtime restored, is still another version.

    Example:
        >>> identity(os.stat("/")).count(":")
        3
    """
    return f"{status.st_dev}:{status.st_ino}:{status.st_mtime_ns}:{status.st_ctime_ns}"


def check_identity(path: str, planned_size: int, planned_version: str | None, status: os.stat_result) -> None:
    """Raise :class:`SourceChangedError` unless ``status`` is of the file planned (size and identity)."""
    if status.st_size != planned_size:
        raise SourceChangedError(
            f"{path}: is {status.st_size} bytes now, {planned_size} when its header was read (it changed while loading)"
        )
    if planned_version is None:
        return
    now = identity(status)
    if now == planned_version:
        return
    planned_device, planned_inode, planned_mtime, planned_ctime = (planned_version.split(":") + ["", "", "", ""])[:4]
    if (planned_device, planned_inode) != (str(status.st_dev), str(status.st_ino)):
        raise SourceChangedError(
            f"{path}: was replaced by another file (inode {planned_inode} -> {status.st_ino}) after its header was "
            "read; load again"
        )
    change = (
        f"mtime_ns {planned_mtime} -> {status.st_mtime_ns}"
        if planned_mtime != str(status.st_mtime_ns)
        else f"ctime_ns {planned_ctime} -> {status.st_ctime_ns}, its mtime unchanged"
    )
    raise SourceChangedError(
        f"{path}: was modified ({change}) after its header was read; its bytes may not match the header"
    )
