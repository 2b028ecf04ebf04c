"""Which destinations this machine offers: checked at call time, never a silent fallback."""

from __future__ import annotations

import logging

import torch

from weightstream.errors import DeviceUnavailableError
from weightstream.memory import pinning

log = logging.getLogger(__name__)


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
            raise DeviceUnavailableError(f"device {device!r} requested, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return False
    if pin_memory is True:
        if not cuda_available():
            raise DeviceUnavailableError(
                f"pin_memory=True needs CUDA (page-locked memory is a CUDA allocation), but torch {torch.__version__} "
                f"sees no CUDA device; use pin_memory='auto' to pin only where CUDA is present"
            )
        if not pinning.pinning_available():
            raise DeviceUnavailableError(f"pin_memory=True needs cuda-python's runtime bindings; {pinning.INSTALL_HINT}")
        return True
    if pin_memory == "auto" and cuda_available():
        if pinning.pinning_available():
            return True
        log.info("pin_memory='auto': CUDA is present but cuda-python is not, so CPU tensors are pageable; %s", pinning.INSTALL_HINT)
    return False
