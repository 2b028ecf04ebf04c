"""Page-locking host memory we mapped ourselves, through ``cudaHostRegister`` (cuda-python).

torch pins only memory it allocates, through a caching allocator that rounds every size up to
a power of two and keeps the pages after the tensors die: a 5 GiB shard would lock 8 GiB for
the life of the process. Registering our own mapping locks exactly its pages, and only while
a tensor still views them.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from weightstream.errors import DeviceUnavailableError, HostMemoryError

INSTALL_HINT = "pip install 'weightstream[cuda]' (cuda-bindings, matching your driver's CUDA major version)"


@functools.cache
def _runtime() -> ModuleType:
    try:
        from cuda.bindings import runtime
    except ImportError as error:
        raise DeviceUnavailableError(f"pinned host memory needs cuda-python's runtime bindings ({error}); {INSTALL_HINT}") from None
    return runtime


def pinning_available() -> bool:
    """Whether cuda-python's runtime bindings can be imported (whether a driver works is seen at use)."""
    try:
        _runtime()
    except DeviceUnavailableError:
        return False
    return True


def register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for every CUDA context (``cudaHostRegisterPortable``).

    Raises:
        DeviceUnavailableError: cuda-python is missing, or no usable driver.
        HostMemoryError: the driver refused (e.g. the locked-memory limit).

    Example:
        >>> register(address, 1 << 30)  # doctest: +SKIP
    """
    runtime = _runtime()
    (status,) = runtime.cudaHostRegister(address, nbytes, runtime.cudaHostRegisterPortable)
    if status != runtime.cudaError_t.cudaSuccess:
        detail = f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: {_describe(runtime, status)}"
        if status in (runtime.cudaError_t.cudaErrorInsufficientDriver, runtime.cudaError_t.cudaErrorNoDevice):
            raise DeviceUnavailableError(detail)
        raise HostMemoryError(detail)


def unregister(address: int) -> None:
    """Undo :func:`register` (called by a finaliser: must not raise, so a failure is reported, not raised)."""
    runtime = _runtime()
    (status,) = runtime.cudaHostUnregister(address)
    if status != runtime.cudaError_t.cudaSuccess:
        warnings.warn(f"cudaHostUnregister at {address:#x} failed: {_describe(runtime, status)}", RuntimeWarning, stacklevel=1)


def _describe(runtime: ModuleType, status: object) -> str:
    _, name = runtime.cudaGetErrorName(status)
    _, text = runtime.cudaGetErrorString(status)
    return f"{name.decode()} ({text.decode()})"
