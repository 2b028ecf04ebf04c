"""Files mapped by address, through the C library's ``mmap``: what Python's ``mmap`` module cannot do (a mapping
that no view of it keeps alive, unmapped when its owner says; an address for ``mincore`` or a device to read).

The page-cache probe, the node cache's fills and its read-only segments for copy engines map files this way.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter already links (find_library: 3 ms)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10


def map_file(fd: int, length: int, prot: int, offset: int = 0) -> int:
    """The address of ``length`` bytes of file ``fd`` from ``offset``, mapped shared with ``prot``; the caller
    unmaps it (:func:`unmap`).

    Raises:
        OSError: the kernel refused (its errno).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as file:
        ...     _ = file.write(b"weights!")
        ...     file.flush()
        ...     address = map_file(file.fileno(), 8, mmap.PROT_READ)
        ...     ctypes.string_at(address, 8), unmap(address, 8)
        (b'weights!', None)
    """
    return _mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)


def _mmap(address: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    """``mmap(2)``: the mapping's address, or the kernel's refusal as an ``OSError`` with its errno."""
    mapped = _libc.mmap(address, length, prot, flags, fd, offset)
    if mapped in (None, MAP_FAILED):
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return mapped


def unmap(address: int, length: int) -> None:
    """Undo :func:`map_file`."""
    _libc.munmap(address, length)


def blank(address: int, length: int) -> None:
    """Replace the mapping at ``address`` (``length`` bytes) with read-only zero pages, in one step: a thread (or a
    NIC's progress thread) still reading there reads zeros, never unmapped memory, and the file's pages are no longer
    held by this mapping. The caller still unmaps it (:func:`unmap`), once nothing can read there.

    Raises:
        OSError: the kernel refused (its errno).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as file:
        ...     _ = file.write(b"weights!")
        ...     file.flush()
        ...     address = map_file(file.fileno(), 8, mmap.PROT_READ)
        ...     blank(address, 8)
        ...     ctypes.string_at(address, 8) == bytes(8), unmap(address, 8)
        (True, None)
    """
    _mmap(address, length, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1, 0)


def fence_off(address: int, length: int) -> None:
    """Replace the mapping at ``address`` (``length`` bytes) with private writable zero pages that the caller never
    unmaps: a writer that cannot be stopped (a NIC's transfer that would not cancel) writes there harmlessly, never
    into the file that was mapped, nor into whatever a later mapping at that address would hold.

    Raises:
        OSError: the kernel refused (its errno).
    """
    _mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1, 0)


def unmap_around(address: int, length: int, kept: list[tuple[int, int]]) -> None:
    """:func:`unmap` the ``length`` bytes at ``address`` but for the ranges ``kept`` (address, length) inside them.

    Example:
        >>> import tempfile
        >>> page = mmap.PAGESIZE
        >>> with tempfile.TemporaryFile() as file:
        ...     _ = file.truncate(3 * page)
        ...     address = map_file(file.fileno(), 3 * page, mmap.PROT_READ)
        ...     unmap_around(address, 3 * page, [(address + page, page)])
        ...     ctypes.string_at(address + page, 2) == bytes(2), unmap(address + page, page)
        (True, None)
    """
    start = address
    for at, size in sorted(kept):
        if address <= at < address + length:
            if at > start:
                unmap(start, at - start)
            start = max(start, at + size)
    if start < address + length:
        unmap(start, address + length - start)


def advise(address: int, length: int, advice: int) -> bool:
    """``madvise``: whether the kernel took the advice (it refuses ``MADV_HUGEPAGE`` without transparent huge
    pages, for one)."""
    return _libc.madvise(address, length, advice) == 0


def resident_pages(address: int, length: int, vector: ctypes.Array[ctypes.c_ubyte]) -> None:
    """``mincore``: one byte per page of the mapping into ``vector`` (its lowest bit: resident).

    Raises:
        OSError: the kernel refused (its errno).
    """
    if _libc.mincore(address, length, vector) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
