"""Tensors whose bytes sit at offsets their dtype cannot view get an aligned copy, bit-exact."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import weightstream


@pytest.mark.parametrize("direct_io", [False, True])
def test_misaligned_tensor_is_copied_to_aligned_memory(tmp_path: Path, direct_io, no_leaks):
    floats = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    header = json.dumps(
        {
            "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "f32": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "misaligned.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x07\x08\x09" + floats.numpy().tobytes())
    loaded = weightstream.load_weights(path, direct_io=direct_io)
    assert loaded["odd"].tolist() == [7, 8, 9]
    assert torch.equal(loaded["f32"], floats)
    assert loaded["f32"].data_ptr() % 4 == 0
