"""Page-locking host memory we mapped ourselves, through ``cudaHostRegister`` (cuda-python).

torch pins only memory it allocates, through a caching allocator that rounds every size up to
a power of two and keeps the pages after the tensors die: a 5 GiB shard would lock 8 GiB for
the life of the process. Registering our own mapping locks exactly its pages, and only while
a tensor still views them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType

from weightstream.errors import DeviceUnavailableError, HostMemoryError

_counter_lock = threading.Lock()
_registered = {"current": 0, "peak": 0}
"""Bytes this process has page-locked through :func:`register` (for benchmarks' peak pinned bytes)."""
_sizes: dict[int, int] = {}
_devices: dict[int, int] = {}
"""Each registration's address -> the device whose runtime made it (and will undo it)."""

INSTALL_HINT = (
    "pip install 'weightstream[cuda12]' or 'weightstream[cuda13]' (cuda-bindings of your driver's CUDA major version, "
    "as nvidia-smi prints it)"
)


@functools.cache
def _runtime() -> ModuleType:
    try:
        from cuda.bindings import runtime
    except ImportError as error:
        raise DeviceUnavailableError(
            f"pinned host memory needs cuda-python's runtime bindings ({error}); {INSTALL_HINT}"
        ) from None
    return runtime


def pinning_available() -> bool:
    """Whether cuda-python's runtime bindings can be imported (whether a driver works is seen at use)."""
    try:
        _runtime()
    except DeviceUnavailableError:
        return False
    return True


def register(address: int, nbytes: int, *, read_only: bool = False, device: int | None = None) -> None:
    """Page-lock ``nbytes`` at ``address`` for every CUDA context (``cudaHostRegisterPortable``), through the
    runtime on ``device`` (default: torch's current device once torch has started CUDA, else 0): the runtime call
    starts that device's context if none is current, never GPU 0's behind a caller on another GPU, and the
    thread's current device is what it was afterwards.

    ``read_only`` (``cudaHostRegisterReadOnly``) locks memory the process may only read (a segment mapped
    ``PROT_READ``): the device only reads it, and the pages are locked as they are, never copied on write.
    Check :func:`read_only_supported` first.

    Raises:
        DeviceUnavailableError: cuda-python is missing, or no usable driver.
        HostMemoryError: the driver refused (e.g. the locked-memory limit).

    Example:
        >>> register(address, 1 << 30)  # doctest: +SKIP
    """
    runtime = _runtime()
    device = _device(device)
    flags = runtime.cudaHostRegisterPortable | (runtime.cudaHostRegisterReadOnly if read_only else 0)
    with _on_device(runtime, device):
        (status,) = runtime.cudaHostRegister(address, nbytes, flags)
    if status != runtime.cudaError_t.cudaSuccess:
        detail = f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: {_describe(runtime, status)}"
        if status in (runtime.cudaError_t.cudaErrorInsufficientDriver, runtime.cudaError_t.cudaErrorNoDevice):
            raise DeviceUnavailableError(detail)
        raise HostMemoryError(detail)
    with _counter_lock:
        _sizes[address] = nbytes
        _devices[address] = device
        _registered["current"] += nbytes
        _registered["peak"] = max(_registered["peak"], _registered["current"])


def read_only_supported(device: int) -> bool:
    """Whether CUDA device ``device`` can lock memory the process may only read (``register(read_only=True)``).

    Raises:
        DeviceUnavailableError: cuda-python is missing, or no usable driver.

    Example:
        >>> read_only_supported(0)  # doctest: +SKIP
        True
    """
    runtime = _runtime()
    attribute = runtime.cudaDeviceAttr.cudaDevAttrHostRegisterReadOnlySupported
    status, supported = runtime.cudaDeviceGetAttribute(attribute, device)
    if status != runtime.cudaError_t.cudaSuccess:
        raise DeviceUnavailableError(
            f"cudaDeviceGetAttribute(HostRegisterReadOnlySupported) on device {device}: {_describe(runtime, status)}"
        )
    return bool(supported)


def unregister(address: int) -> None:
    """Undo :func:`register` (called by a finaliser: must not raise, so a failure is reported, not raised)."""
    runtime = _runtime()
    with _counter_lock:
        device = _devices.pop(address, 0)
    with _on_device(runtime, device):
        (status,) = runtime.cudaHostUnregister(address)
    with _counter_lock:
        _registered["current"] -= _sizes.pop(address, 0)
    if status != runtime.cudaError_t.cudaSuccess:
        warnings.warn(
            f"cudaHostUnregister at {address:#x} failed: {_describe(runtime, status)}", RuntimeWarning, stacklevel=1
        )


def registered_bytes() -> tuple[int, int]:
    """``(now, peak)`` bytes page-locked by weightstream in this process.

    Example:
        >>> now, peak = registered_bytes()
        >>> 0 <= now <= peak
        True
    """
    with _counter_lock:
        return _registered["current"], _registered["peak"]


def _device(device: int | None) -> int:
    """``device``, else torch's current device where torch has started CUDA, else 0."""
    if device is not None:
        return device
    import torch

    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


@contextlib.contextmanager
def _on_device(runtime: ModuleType, device: int) -> Iterator[None]:
    """The runtime's current device ``device`` on this thread for the block, the previous one back after it."""
    status, previous = runtime.cudaGetDevice()
    switch = status == runtime.cudaError_t.cudaSuccess and previous != device
    if switch:
        runtime.cudaSetDevice(device)
    try:
        yield
    finally:
        if switch:
            runtime.cudaSetDevice(previous)


def _describe(runtime: ModuleType, status: object) -> str:
    _, name = runtime.cudaGetErrorName(status)
    _, text = runtime.cudaGetErrorString(status)
    return f"{name.decode()} ({text.decode()})"
