"""Which destinations this machine offers: checked at call time, never a silent fallback."""

from __future__ import annotations

import torch

from weightstream.errors import DeviceMemoryError, DeviceUnavailableError, HostMemoryError, logger
from weightstream.memory import pinning

log = logger(__name__)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False on CPU builds, without importing any CUDA code)."""
    return torch.cuda.is_available()


def check_destination(device: str, pin_memory: bool | str) -> bool:
    """Raise if ``device`` or pinned memory needs CUDA this machine lacks; return whether to pin.

    Example:
        >>> check_destination("cpu", False)
        False
    """
    target = torch.device(device)
    if target.type == "cuda":
        if not cuda_available():
            raise DeviceUnavailableError(
                f"device {device!r} requested, but torch {torch.__version__} sees no CUDA device; "
                f"nothing falls back to the CPU: pass device='cpu' to load there"
            )
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device {device!r} requested, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return False
    if pin_memory is True:
        if not cuda_available():
            raise DeviceUnavailableError(
                f"pin_memory=True needs CUDA (page-locked memory is a CUDA allocation), but torch {torch.__version__} "
                f"sees no CUDA device; use pin_memory='auto' to pin only where CUDA is present"
            )
        if not pinning.pinning_available():
            raise DeviceUnavailableError(
                f"pin_memory=True needs cuda-python's runtime bindings; {pinning.INSTALL_HINT}"
            )
        return True
    if pin_memory == "auto" and cuda_available():
        if pinning.pinning_available():
            return True
        log.info(
            "pin_memory='auto': CUDA is present but cuda-python is not, so CPU tensors are pageable; %s",
            pinning.INSTALL_HINT,
        )
    return False


def check_fits(nbytes: int, device: str, what: str) -> None:
    """Raise before anything is sized from ``nbytes`` if the destination could never hold that much at
    once: more than the GPU's memory, or than this machine's RAM and swap together. A header claiming
    2**50 bytes is refused here, instead of a planner building a request for every chunk of it.

    Example:
        >>> check_fits(2**50, "cpu", "model.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        weightstream.errors.HostMemoryError: model.safetensors: needs 1125899906842624 bytes of memory at once, ...
    """
    target = torch.device(device)
    if target.type == "cuda":
        index = target.index if target.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        if nbytes > total:
            raise DeviceMemoryError(
                f"{what}: needs {nbytes} bytes of device memory at once, more than {device} has ({total} bytes)"
            )
        return
    limit = host_memory_limit()
    if nbytes > limit:
        raise HostMemoryError(
            f"{what}: needs {nbytes} bytes of memory at once, more than this machine has ({limit} bytes of RAM and "
            "swap)"
        )


def host_memory_limit() -> int:
    """RAM plus swap (``/proc/meminfo``): no allocation of more can ever succeed.

    Example:
        >>> host_memory_limit() > 0
        True
    """
    totals = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, _, value = line.partition(":")
            if key in ("MemTotal", "SwapTotal"):
                totals[key] = int(value.split()[0]) * 1024
    return totals.get("MemTotal", 0) + totals.get("SwapTotal", 0)
