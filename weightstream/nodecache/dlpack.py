"""Memory at an address as a torch tensor, through DLPack: no numpy (``torch.as_tensor`` over
``__cuda_array_interface__`` needs it), no copy, and a callback when the tensor's last view dies.

A ``DLManagedTensor`` is built with ctypes and handed to ``torch.from_dlpack`` in a capsule named ``dltensor``;
torch calls its deleter when it frees the tensor's storage, and the deleter runs ``on_free`` (the GPU tier unmaps
an imported allocation there).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

from weightstream.errors import DeviceUnavailableError, logger

log = logger(__name__)

DEVICE_TYPES = {"cpu": 1, "cuda": 2}
"""DLPack's ``kDLCPU`` and ``kDLCUDA``."""
UINT = 1
"""DLPack's ``kDLUInt`` type code."""


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _ManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensor))
_ManagedTensor._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_live: dict[int, tuple[_ManagedTensor, ctypes.Array[ctypes.c_int64], Callable[[], None]]] = {}
"""Each handed-out tensor's structures and callback, by the address torch gives back to the deleter (they must
outlive the capsule: torch reads them until it frees the tensor)."""
_live_lock = threading.Lock()


@_DELETER
def _deleter(managed: ctypes._Pointer[_ManagedTensor]) -> None:
    with _live_lock:
        _, _, on_free = _live.pop(ctypes.addressof(managed.contents), (None, None, None))  # type: ignore[arg-type]
    if on_free is not None:
        try:
            on_free()
        except Exception:  # a deleter must not raise into torch's free
            log.exception("releasing memory behind a tensor failed")


def tensor_at(address: int, nbytes: int, device: torch.device, on_free: Callable[[], None]) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` at ``address`` on ``device`` (``cpu`` or ``cuda:N``), the memory not copied;
    ``on_free()`` runs once torch frees it (its last view gone).

    Raises:
        DeviceUnavailableError: a device DLPack has no type for here.

    Example:
        >>> import ctypes
        >>> buffer = ctypes.create_string_buffer(b"weights", 7)
        >>> view = tensor_at(ctypes.addressof(buffer), 7, torch.device("cpu"), lambda: None)
        >>> bytes(view.tolist()), view.data_ptr() == ctypes.addressof(buffer)
        (b'weights', True)
    """
    if device.type not in DEVICE_TYPES:
        raise DeviceUnavailableError(f"{device}: no DLPack device type for it here")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _ManagedTensor()
    managed.dl_tensor = _Tensor(
        address,
        _Device(DEVICE_TYPES[device.type], device.index or 0),
        1,
        _DataType(UINT, 8, 1),
        shape,
        None,
        0,
    )
    managed.deleter = _deleter
    with _live_lock:
        _live[ctypes.addressof(managed)] = (managed, shape, on_free)
    try:
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.from_dlpack(capsule)
    except BaseException:
        with _live_lock:
            _live.pop(ctypes.addressof(managed), None)
        raise
