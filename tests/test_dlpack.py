"""Memory at an address as a tensor through DLPack (the GPU tier's import, without numpy): no copy, and the
release callback runs once, when the last view dies. Tested here on host memory; the CUDA tier uses the same path
with the CUDA device type."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import pytest
import torch

from weightstream.errors import DeviceUnavailableError
from weightstream.nodecache.dlpack import tensor_at


def test_a_tensor_at_an_address_is_that_memory_and_is_released_with_its_last_view():
    buffer = ctypes.create_string_buffer(bytes(range(64)), 64)
    released: list[int] = []
    whole = tensor_at(ctypes.addressof(buffer), 64, torch.device("cpu"), lambda: released.append(1))
    assert whole.data_ptr() == ctypes.addressof(buffer) and whole.dtype == torch.uint8 and whole.shape == (64,)
    part = whole[8:16]
    buffer[8] = 200  # the same bytes: no copy was made
    assert part.tolist() == [200, *range(9, 16)]
    del whole
    gc.collect()
    assert released == []
    del part
    gc.collect()
    assert released == [1]


def test_an_unknown_device_is_refused():
    with pytest.raises(DeviceUnavailableError, match=r"meta: no DLPack device type for it here"):
        tensor_at(0, 1, torch.device("meta"), lambda: None)


def test_no_numpy_is_needed():
    script = (
        "import sys, ctypes\n"
        "class NoNumpy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'numpy': raise ModuleNotFoundError(name=name)\n"
        "sys.meta_path.insert(0, NoNumpy())\n"
        "import torch\n"
        "from weightstream.nodecache.dlpack import tensor_at\n"
        "buffer = ctypes.create_string_buffer(b'abc', 3)\n"
        "print(tensor_at(ctypes.addressof(buffer), 3, torch.device('cpu'), lambda: None).tolist())\n"
        "assert 'numpy' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "[97, 98, 99]"), result.stderr[-2000:]
