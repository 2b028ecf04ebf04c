"""Which destinations this machine offers: checked at call time, never a silent fallback."""

from __future__ import annotations

import torch

from weightstream.errors import DeviceUnavailableError


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False on CPU builds, without importing any CUDA code)."""
    return torch.cuda.is_available()


def check_destination(device: str, pin_memory: bool | str) -> bool:
    """Raise if ``device`` or pinned memory needs CUDA this machine lacks; return whether to pin.

    Example:
        >>> check_destination("cpu", False)
        False
    """
    if torch.device(device).type == "cuda" and not cuda_available():
        raise DeviceUnavailableError(
            f"device {device!r} requested, but torch {torch.__version__} sees no CUDA device; "
            f"nothing falls back to the CPU: pass device='cpu' to load there"
        )
    if pin_memory is True and not cuda_available():
        raise DeviceUnavailableError(
            f"pin_memory=True needs CUDA (page-locked memory is a CUDA allocation), but torch {torch.__version__} "
            f"sees no CUDA device; use pin_memory='auto' to pin only where CUDA is present"
        )
    return pin_memory is True or (pin_memory == "auto" and cuda_available())
