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
import weakref

import torch

from weightstream.errors import HostMemoryError
from weightstream.memory import pinning
from weightstream.sources.local.raw_mapping import map_file, unmap


def map_read_only(
    fd: int, nbytes: int, *, page_locked: bool = False, what: str = "a segment", device: int | None = None
) -> torch.Tensor:
    """``nbytes`` of the file ``fd`` (uint8), mapped shared and read-only, page-locked for every CUDA context if
    ``page_locked`` (through ``device``'s runtime: see :func:`weightstream.memory.pinning.register`). Unlocked and
    unmapped when the last tensor over it dies; ``fd`` may be closed at once.

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
    try:
        address = map_file(fd, nbytes, mmap.PROT_READ)
    except OSError as error:
        raise HostMemoryError(f"{what}: cannot map its {nbytes} bytes read-only: {error.strerror}") from None
    try:
        if page_locked:
            pinning.register(address, nbytes, read_only=True, device=device)
    except BaseException:
        unmap(address, nbytes)
        raise
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    finaliser = weakref.finalize(array, _release, address, nbytes, page_locked)
    finaliser.atexit = False  # at exit the process unmaps everything anyway, and the CUDA runtime may be gone
    return torch.frombuffer(array, dtype=torch.uint8)


def _release(address: int, nbytes: int, page_locked: bool) -> None:
    if page_locked:
        pinning.unregister(address)
    unmap(address, nbytes)
