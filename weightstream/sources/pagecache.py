"""The page cache: how much of a file is in it (``mincore``), and, for benchmarks, dropping and warming it."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value

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


def resident_fraction(path: str) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore``).

    Example:
        >>> resident_fraction(__file__) > 0  # doctest: +SKIP
        True
    """
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + page - 1) // page
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            # One byte per page; only its lowest bit is defined, the others are zero today.
            return (pages - ctypes.string_at(vector, pages).count(0)) / pages
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
