"""GPUDirect Storage: cuFile reads from an O_DIRECT file straight into device memory.

Through cuda-python's ``cuda.bindings.cufile`` (which loads ``libcufile.so.0`` from the
``nvidia-cufile`` package or the CUDA toolkit). Real GPUDirect needs the ``nvidia-fs`` kernel
module (or PCI P2PDMA) and a supported filesystem; without them cuFile runs in compatibility
mode, plain POSIX reads through its own bounce buffers, which the staging ring does better.
So ``gds="auto"`` uses cuFile only where ``nvidia-fs`` is loaded, and says why not otherwise;
``gds=True`` uses it wherever the library opens, and raises where it does not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from weightstream.errors import DeviceUnavailableError
from weightstream.memory.pinning import INSTALL_HINT
from weightstream.sources.local.identity import check_identity
from weightstream.sources.local.regular import open_regular

NVIDIA_FS = "/sys/module/nvidia_fs"
"""Present when the nvidia-fs kernel module (true GPUDirect DMA) is loaded."""


def bindings() -> ModuleType:
    """cuda-python's cuFile module.

    Raises:
        DeviceUnavailableError: cuda-python (12.8 or newer) is not installed.
    """
    try:
        from cuda.bindings import cufile
    except ImportError as error:
        raise DeviceUnavailableError(
            f"GPUDirect Storage needs cuda-python's cuFile bindings ({error}); {INSTALL_HINT}"
        ) from None
    return cufile


def unavailable_reason(*, need_nvidia_fs: bool) -> str | None:
    """Why cuFile cannot serve a load here, or None when it can.

    Example:
        >>> reason = unavailable_reason(need_nvidia_fs=True)
        >>> reason is None or isinstance(reason, str)
        True
    """
    try:
        cufile = bindings()
    except DeviceUnavailableError as error:
        return str(error)
    try:
        cufile.driver_open()
    except Exception as error:  # noqa: BLE001 - a missing library raises RuntimeError, a refusing driver cuFileError
        return f"cuFileDriverOpen failed: {error}"
    cufile.driver_close()
    if need_nvidia_fs and not os.path.exists(NVIDIA_FS):
        return (
            "the nvidia-fs kernel module is not loaded, so cuFile would run in compatibility mode "
            "(POSIX reads through bounce buffers)"
        )
    return None


@contextlib.contextmanager
def driver() -> Iterator[ModuleType]:
    """The cuFile driver, open for the duration of a load."""
    cufile = bindings()
    try:
        cufile.driver_open()
    except Exception as error:  # noqa: BLE001 - see unavailable_reason
        raise DeviceUnavailableError(f"GPUDirect Storage: cuFileDriverOpen failed: {error}") from None
    try:
        yield cufile
    finally:
        cufile.driver_close()


@contextlib.contextmanager
def registered_buffer(cufile: ModuleType, buffer: torch.Tensor) -> Iterator[int]:
    """``buffer``'s device address, registered with cuFile (pinned for DMA) while in use."""
    address, nbytes = buffer.data_ptr(), buffer.numel()
    if nbytes == 0:
        yield address
        return
    cufile.buf_register(address, nbytes, 0)
    try:
        yield address
    finally:
        cufile.buf_deregister(address)


@contextlib.contextmanager
def registered_file(cufile: ModuleType, path: str, planned_size: int, planned_version: str | None) -> Iterator[int]:
    """A cuFile handle on ``path`` opened with O_DIRECT, checked to still be the file planned (size and identity)."""
    fd, status = open_regular(path, os.O_DIRECT)
    try:
        check_identity(path, planned_size, planned_version, status)
        descriptor = cufile.Descr()
        descriptor.type = cufile.FileHandleType.OPAQUE_FD
        descriptor.handle.fd = fd
        try:
            handle = cufile.handle_register(descriptor.ptr)
        except cufile.cuFileError as error:
            raise DeviceUnavailableError(f"{path}: cuFileHandleRegister refused the file: {error}") from None
        try:
            yield handle
        finally:
            cufile.handle_deregister(handle)
    finally:
        os.close(fd)
