"""Shared memory mapped read-only, for a copy engine to read from: a node-cache segment as a DMA source.

A CUDA destination copies a segment straight to the device when the segment is page-locked in place.
The private (copy-on-write) mapping that CPU clients view cannot serve: locking a writable private
mapping may copy every page into fresh memory. So the segment is mapped a second time, shared and
``PROT_READ``, and locked with ``cudaHostRegisterReadOnly``: the pages locked are the segment's own.
The tensor over it is for reading only (a write would fault); it never reaches a caller.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

from weightstream.errors import HostMemoryError
from weightstream.memory import pinning

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


def map_read_only(fd: int, nbytes: int, *, page_locked: bool = False, what: str = "a segment") -> torch.Tensor:
    """``nbytes`` of the file ``fd`` (uint8), mapped shared and read-only, page-locked for every CUDA context if
    ``page_locked``. Unlocked and unmapped when the last tensor over it dies; ``fd`` may be closed at once.

    Raises:
        HostMemoryError: the mapping failed; or (``page_locked``) the driver refused to lock it.
        DeviceUnavailableError: ``page_locked`` without cuda-python or a driver.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as file:
        ...     _ = file.write(b"weights!")
        ...     file.flush()
        ...     bytes(map_read_only(file.fileno(), 8).numpy())
        b'weights!'
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    address = _mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, MAP_FAILED):
        raise HostMemoryError(f"{what}: cannot map its {nbytes} bytes read-only: {os.strerror(ctypes.get_errno())}")
    try:
        if page_locked:
            pinning.register(address, nbytes, read_only=True)
    except BaseException:
        _munmap(address, nbytes)
        raise
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    finaliser = weakref.finalize(array, _release, address, nbytes, page_locked)
    finaliser.atexit = False  # at exit the process unmaps everything anyway, and the CUDA runtime may be gone
    return torch.frombuffer(array, dtype=torch.uint8)


def _release(address: int, nbytes: int, page_locked: bool) -> None:
    if page_locked:
        pinning.unregister(address)
    _munmap(address, nbytes)
