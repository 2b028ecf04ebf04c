"""The page cache: how much of a file is in it (``mincore``), and, for benchmarks, dropping and warming it."""

from __future__ import annotations

import ctypes
import mmap
import os

from weightstream.errors import SourceError
from weightstream.sources.local.raw_mapping import map_file, resident_pages, unmap
from weightstream.sources.local.regular import open_regular

BLOCK = 16 << 20


def drop(path: str) -> None:
    """Ask the kernel to evict ``path`` from the page cache (it must not be dirty)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: str) -> None:
    """Read ``path`` once so that it is in the page cache."""
    buffer = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as file:
        while file.readinto(buffer):
            pass


WINDOW_BYTES = 64 << 20
"""The probe maps and asks about this much of a file at a time (a 16 KiB vector), whatever the file's size."""
MAX_WINDOWS = 1024
"""Files of more windows than this (over 64 GiB) are sampled at this many evenly spaced windows, so the
time is bounded too (the kernel takes about 45 ns a page: 0.75 s at most)."""


def resident_fraction(path: str, *, sampled: bool = False) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore``), probed in bounded windows.

    Memory and time are bounded whatever size the file claims (a sparse 2 TiB file costs one 16 KiB
    vector and under a second); only one descriptor is held, for the call. A file that is not a regular
    file raises :class:`UnsupportedInputError`, one the kernel will not map :class:`SourceError`, naming it.
    ``sampled=True`` estimates it from :data:`SAMPLE_WINDOWS` windows (what ``direct_io="auto"`` decides by).

    Example:
        >>> resident_fraction(__file__) > 0  # doctest: +SKIP
        True
    """
    fd, status = open_regular(path)
    try:
        return fd_resident_fraction(fd, status.st_size, path, sampled=sampled)
    finally:
        os.close(fd)


SAMPLE_WINDOW_BYTES = 1 << 20
SAMPLE_WINDOWS = 64
"""How :func:`fd_resident_fraction` estimates with ``sampled=True``: 64 evenly spaced 1 MiB windows (16,384
pages, about 2 ms), where probing every page of a warm 2 GiB file took 40 ms before its first read."""


def fd_resident_fraction(fd: int, size: int, path: str, *, sampled: bool = False) -> float:
    """:func:`resident_fraction` of an open file of ``size`` bytes (``path`` names it in errors); with
    ``sampled``, an estimate from :data:`SAMPLE_WINDOWS` evenly spaced windows (enough to choose how to read)."""
    if size == 0:
        return 1.0
    page = mmap.PAGESIZE
    window_bytes, most = (SAMPLE_WINDOW_BYTES, SAMPLE_WINDOWS) if sampled else (WINDOW_BYTES, MAX_WINDOWS)
    windows = (size + window_bytes - 1) // window_bytes
    chosen = range(windows) if windows <= most else sorted({number * windows // most for number in range(most)})
    vector = (ctypes.c_ubyte * (window_bytes // page))()
    resident = probed = 0
    for number in chosen:
        offset = number * window_bytes
        length = min(window_bytes, size - offset)
        pages = (length + page - 1) // page
        try:
            address = map_file(fd, length, mmap.PROT_READ, offset)
        except OSError as error:
            raise SourceError(
                f"{path}: cannot map bytes {offset}..{offset + length} to probe the page cache: {error.strerror}"
            ) from None
        try:
            resident_pages(address, length, vector)
        except OSError as error:
            raise SourceError(
                f"{path}: mincore of bytes {offset}..{offset + length} failed: {error.strerror}"
            ) from None
        finally:
            unmap(address, length)
        # One byte per page; only its lowest bit is defined, the others are zero today.
        resident += pages - ctypes.string_at(vector, pages).count(0)
        probed += pages
    return resident / probed
