"""Pageable host memory that the caller owns, carved into tensors.

One anonymous mapping per file holds that file's tensors. An anonymous mapping (not
``torch.empty``) lets us ask for transparent huge pages: on these VMs the first write
to a fresh 4 KiB page costs more than the copy itself, and 2 MiB pages cut that cost
several times over (see ``benchmarks/README.md``). The mapping is freed when the last
tensor viewing it is garbage collected: ``torch.frombuffer`` keeps the mapping alive.

A pinned arena is the same mapping, page-locked with ``cudaHostRegister``. Its tensors view a
ctypes array over the mapping whose finaliser unregisters the pages: that finaliser runs when
the last tensor dies and before the mapping is unmapped (the array still holds it then).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
import weakref

import torch

from weightstream.errors import HostMemoryError, logger
from weightstream.memory import pinning
from weightstream.planning.plan import TensorSpec
from weightstream.sources.local.raw_mapping import advise

log = logger(__name__)

MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault pages in writable without writing to them (not in Python's mmap module yet)."""


class HostArena:
    """``nbytes`` of zero-initialised, page-aligned, caller-owned memory, page-locked if ``pinned``.

    Example:
        >>> arena = HostArena(4096, huge_pages=False)
        >>> arena.view[:4] = b"\\x01\\x00\\x00\\x00"
        >>> spec = TensorSpec("w", torch.int32, (1,), "f", 0, 4)
        >>> arena.tensor(0, spec).tolist()
        [1]
    """

    def __init__(self, nbytes: int, *, huge_pages: bool, pinned: bool = False) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self._mapping = None
        self._populate_works = True
        if nbytes == 0:
            self.bytes = torch.empty(0, dtype=torch.uint8, pin_memory=pinned)
            self.view = memoryview(b"")
            return
        try:
            mapping = self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as error:
            raise HostMemoryError(f"cannot map {nbytes} bytes of host memory: {error.strerror}") from None
        if huge_pages:
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError as error:  # THP disabled in this kernel: 4 KiB pages still work, only slower.
                log.info("madvise(MADV_HUGEPAGE) refused (%s); using 4 KiB pages", error)
        exported = (ctypes.c_ubyte * nbytes).from_buffer(mapping)
        self._address = ctypes.addressof(exported)
        del exported  # an export of the mapping would keep it from closing
        try:
            exporter = _pinned(mapping, nbytes) if pinned else mapping
        except BaseException:
            mapping.close()  # unmapped now, not when the caller lets go of the traceback
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer warns on buffers it cannot prove writable
            self.bytes = torch.frombuffer(exporter, dtype=torch.uint8)
        self.view = memoryview(mapping)

    def populate(self, offset: int, nbytes: int) -> None:
        """Fault in (allocate and zero) the pages under ``[offset, offset + nbytes)`` ahead of their use.

        Called through ctypes, which lets go of the GIL: ``mmap.madvise`` holds it, and faulting
        64 MiB in takes tens of milliseconds during which no other reader thread could run
        (measured on the streaming loader: 0.83 GB/s holding it, 0.91 without; benchmarks/README.md).
        """
        if self._mapping is None or nbytes == 0 or self.pinned or not self._populate_works:
            return  # page-locking faulted every page in already
        start = offset - offset % mmap.PAGESIZE
        if not advise(self._address + start, min(self.nbytes, offset + nbytes) - start, MADV_POPULATE_WRITE):
            # Kernels before 5.14; the readers then fault the pages themselves.
            self._populate_works = False
            log.info(
                "madvise(MADV_POPULATE_WRITE) refused (%s); pages fault in as they are written",
                os.strerror(ctypes.get_errno()),
            )

    def tensor(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """The tensor ``spec`` whose bytes sit at ``offset``: a view when aligned, else an aligned copy."""
        return view_as(self.bytes, offset, spec)


def _pinned(mapping: mmap.mmap, nbytes: int) -> ctypes.Array:
    """A ctypes array over ``mapping``, page-locked until the array dies (with the last tensor over it)."""
    array = (ctypes.c_ubyte * nbytes).from_buffer(mapping)
    address = ctypes.addressof(array)
    try:
        pinning.register(address, nbytes)
    except BaseException:
        del array  # its export of the mapping would keep the mapping from closing
        raise
    finaliser = weakref.finalize(array, pinning.unregister, address)
    finaliser.atexit = False  # at interpreter exit the CUDA runtime may be gone; the process unlocks its pages anyway
    return array


def view_as(raw_bytes: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """``spec`` over ``raw_bytes[offset:]``: a view when ``offset`` suits the dtype, else an aligned copy.

    Example:
        >>> raw = torch.tensor([0, 1, 0, 0, 0], dtype=torch.uint8)
        >>> view_as(raw, 1, TensorSpec("w", torch.int32, (), "f", 0, 4)).item()
        1
    """
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype, device=raw_bytes.device, pin_memory=raw_bytes.is_pinned())
    raw = raw_bytes[offset : offset + spec.nbytes]
    if offset % spec.dtype.itemsize == 0:
        return raw.view(spec.dtype).view(spec.shape)
    aligned = torch.empty(spec.shape, dtype=spec.dtype, device=raw_bytes.device, pin_memory=raw_bytes.is_pinned())
    aligned.view(-1).view(torch.uint8).copy_(raw)
    return aligned
